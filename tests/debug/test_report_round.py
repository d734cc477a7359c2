"""The report round's rules, on an in-process store: one reporter per hang, a stale request
replaced, the followers read the one verdict, and who is waited for before leaving."""

import threading
import time

import torch.distributed as dist

from plait.debug import report_round as rounds
from plait.debug.desync import EXITED, FAILED, IN_OP, RUNNING


def _state(rank: int, status: str) -> dict:
    return {"rank": rank, "status": status}


def test_the_first_claim_holds_and_every_later_one_reads_it():
    store = dist.HashStore()
    first = rounds.claim(store, {"rank": 1, "time_ns": 100, "op": "barrier #1"}, born_ns=0)
    second = rounds.claim(store, {"rank": 0, "time_ns": 101, "op": "send #2"}, born_ns=0)
    assert first == second == {"rank": 1, "time_ns": 100, "op": "barrier #1"}
    assert rounds.pending_request(store, born_ns=0) == first
    assert rounds.pending_request(store, born_ns=200) is None  # made before this session


def test_a_request_left_by_an_earlier_session_is_replaced_with_its_report():
    store = dist.HashStore()
    rounds.claim(store, {"rank": 1, "time_ns": 100, "op": "old"}, born_ns=0)
    rounds.publish(store, rank=1, op="old", text="old report", verdict={}, states={})
    mine = rounds.claim(store, {"rank": 0, "time_ns": 300, "op": "new"}, born_ns=200)
    assert mine["op"] == "new" and not store.check([rounds.REPORT])


def test_a_follower_waits_for_the_published_report_and_gives_up_in_bounded_time():
    store = dist.HashStore()
    t0 = time.monotonic()
    assert rounds.await_report(store, 0.2) is None
    assert time.monotonic() - t0 < 30  # bounded: 0.2 s asked, slack for a loaded machine
    states = {0: _state(0, IN_OP), 1: None}
    later = threading.Timer(0.1, rounds.publish, kwargs=dict(store=store, rank=0, op="send #2", text="the report",
                                                              verdict={"culprits": [1]}, states=states))
    later.start()
    report = rounds.await_report(store, 60.0)
    later.join()
    assert report["text"] == "the report" and report["verdict"] == {"culprits": [1]}
    assert report["states"] == states  # rank keys come back as ints


def test_only_ranks_that_took_part_are_waited_for():
    states = {0: _state(0, IN_OP), 1: _state(1, RUNNING), 2: _state(2, EXITED), 3: _state(3, FAILED), 4: None}
    assert rounds.still_reading(states, me=0) == [1]
    assert rounds.still_reading(states, me=1) == [0]


def test_leave_waits_for_the_peers_done_and_names_the_late_ones():
    store = dist.HashStore()
    assert rounds.leave(store, 0, [1, 2], 0.2) == [1, 2]
    threading.Timer(0.1, store.set, args=(rounds.done_key(1), "1")).start()
    assert rounds.leave(store, 2, [0, 1], 60.0) == []


def test_the_store_host_waits_for_peers_that_neither_ended_nor_reported():
    store = dist.HashStore()
    store.set(rounds.state_key(1), '{"status": "exited"}')
    store.set(rounds.state_key(2), '{"status": "in op"}')
    store.set(rounds.done_key(3), "1")
    assert rounds.unfinished(store, 0, 5) == [2, 4]
