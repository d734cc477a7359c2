"""The rendezvous protocol itself, in-process: several StoreRendezvous on one real TCPStore, in threads.

Each test is a rule of the protocol: when a round closes, who gets which group rank, one end per
round, restarts counted once per job, late joiners, static node ranks.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from plait.run.args import parse_config
from plait.run.heartbeat import Liveness
from plait.run.rendezvous import JobOver, RendezvousError, StoreRendezvous
from plait.run.rounds import EndReason, NodeInfo, RoundEnd
from plait.run.store import RdzvStore
from tests.run.conftest import worker

dist = pytest.importorskip("torch.distributed")
_job_ids = itertools.count()
# The join timeout of these jobs, and the last call of a test that must not wait for one: a
# round closes in milliseconds, so half of this tells "closed at once" from "waited" under any
# load. The nodes here never beat: the same bound keeps them from being seen as lost.
JOIN_S = 60.0


@pytest.fixture(scope="module")
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))


@pytest.fixture
def nodes(server):
    """nodes(n, nnodes=..., ...) -> n StoreRendezvous of one fresh job on the shared store."""
    run_id = f"test{next(_job_ids)}"

    def make(n: int, *, nnodes: str, last_call: float = 5.0, backend: str = "c10d", max_restarts: int = 1,
             node_ranks=None, nproc: int = 2) -> list[StoreRendezvous]:
        flags = ["--nnodes", nnodes, "--rdzv-backend", backend, "--rdzv-id", run_id, "--max-restarts", str(max_restarts),
                 "--rdzv-conf", f"join_timeout={JOIN_S},last_call_timeout={last_call},keep_alive_interval=0.2"]
        flags += ["--rdzv-endpoint", f"127.0.0.1:{server.port}"] if backend == "c10d" else ["--master-port", str(server.port)]
        cfg = parse_config([*flags, worker("env_dump.py")])
        out = []
        for i in range(n):
            store = RdzvStore(dist.TCPStore("127.0.0.1", server.port, is_master=False), run_id=run_id,
                              endpoint=f"127.0.0.1:{server.port}")
            me = NodeInfo(node_id=f"node{i}", name=f"node{i}", addr="127.0.0.1", nproc=nproc,
                          node_rank=node_ranks[i] if node_ranks else 0, prev_group_rank=None, worker_port=0)
            out.append(StoreRendezvous(cfg, store, me, sleep=time.sleep, liveness=Liveness(store, JOIN_S),
                                       is_host=False, on_close=lambda: None))
        return out

    return make


def join_all(rdzvs, prevs=None):
    """next_round on every node at once; returns [(RoundInfo, WorkerStore | None)] or raises the first error."""
    prevs = prevs or [None] * len(rdzvs)
    with ThreadPoolExecutor(len(rdzvs)) as pool:
        futures = [pool.submit(r.next_round, p) for r, p in zip(rdzvs, prevs)]
        results = [f.result(timeout=2 * JOIN_S) for f in futures]
    for _, ws in results:
        if ws is not None:
            ws.close()
    return [info for info, _ in results], [ws for _, ws in results]


def test_round_closes_at_once_at_max_nodes_with_contiguous_ranks(nodes):
    t0 = time.monotonic()
    infos, stores = join_all(nodes(3, nnodes="2:3", last_call=JOIN_S))
    assert time.monotonic() - t0 < JOIN_S / 2  # did not wait for the last call
    assert sorted(i.group_rank for i in infos) == [0, 1, 2]
    for info in infos:
        assert info.world_size == 6 and info.rank_offset == 2 * info.group_rank and info.round == 0
        assert info.nodes == infos[0].nodes  # everyone agrees on the membership
    # only group rank 0 serves this round's worker store, at MASTER_PORT
    assert [ws is not None for ws in stores] == [i.group_rank == 0 for i in infos]
    assert infos[0].master_port == next(i for i in infos if i.group_rank == 0).me.worker_port


def test_round_closes_after_the_last_call_with_min_nodes(nodes):
    t0 = time.monotonic()
    infos, _ = join_all(nodes(2, nnodes="2:3", last_call=0.5))
    assert 0.5 <= time.monotonic() - t0 < JOIN_S / 2  # closed by the last call, not the join timeout
    assert len(infos[0].nodes) == 2


def test_one_end_per_round_and_restarts_counted_once_for_the_job(nodes):
    a, b = nodes(2, nnodes="2", max_restarts=1)
    infos, _ = join_all([a, b])
    with ThreadPoolExecutor(2) as pool:  # both nodes see a failure at the same moment
        ends = list(pool.map(lambda ri: ri[0].end_round(ri[1], EndReason.FAILURE, f"from {ri[1].me.name}"),
                             zip([a, b], infos)))
    assert ends[0] == ends[1] and ends[0].restarts == 1 and not ends[0].final
    a.advance(infos[0])
    b.advance(infos[1])
    infos2, _ = join_all([a, b], infos)
    assert [i.round for i in infos2] == [1, 1] and [i.restarts for i in infos2] == [1, 1]
    again = a.end_round(infos2[0], EndReason.FAILURE, "again")
    assert again.restarts == 2 and again.final  # past --max-restarts 1: the job is over
    assert b.check_round(infos2[1]) == again


def test_survivors_keep_their_group_ranks_across_rounds(nodes):
    a, b = nodes(2, nnodes="2")
    infos, _ = join_all([a, b])
    by_name = {i.me.name: i.group_rank for i in infos}
    a.end_round(infos[0], EndReason.FAILURE, "x")
    a.advance(infos[0])
    infos2, _ = join_all([b, a], [infos[1], infos[0]])  # joining in the other order
    assert {i.me.name: i.group_rank for i in infos2} == by_name


def test_late_node_waits_then_the_members_regroup_without_spending_a_restart(nodes):
    a, b, late = nodes(3, nnodes="2:3", last_call=0.2, max_restarts=0)
    infos, _ = join_all([a, b])
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(late.next_round, None)
        deadline = time.monotonic() + JOIN_S
        end = None
        while end is None and time.monotonic() < deadline:
            end = a.check_round(infos[0])
            time.sleep(0.05)
        assert end.reason is EndReason.MEMBERSHIP and not end.final and end.restarts == 0
        a.advance(infos[0])
        infos2, _ = join_all([a, b], infos)
        late_info, ws = waiting.result(timeout=JOIN_S)
    assert len(infos2[0].nodes) == 3 and late_info.round == 1 and late_info.group_rank == 2


def test_job_ending_while_a_node_waits_ends_that_node_too(nodes):
    a, b, late = nodes(3, nnodes="2:3", last_call=0.2)
    infos, _ = join_all([a, b])
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(late.next_round, None)
        time.sleep(0.3)
        a.end_round(infos[0], EndReason.SUCCESS, "all workers exited 0")
        with pytest.raises(JobOver) as over:
            waiting.result(timeout=JOIN_S)
    assert over.value.end.succeeded


def test_static_rendezvous_rejects_two_nodes_with_the_same_node_rank(nodes):
    with pytest.raises(RendezvousError, match=r"node[01] and node[01] both use --node-rank 1"):
        join_all(nodes(2, nnodes="2", backend="static", node_ranks=[1, 1]))


def test_round_end_decisions():
    def decide(reason, before, final=False):
        return RoundEnd.decide(round=0, reason=reason, restarts_before=before, max_restarts=2, by="n",
                               detail="", final=final)

    assert (decide(EndReason.FAILURE, 1).restarts, decide(EndReason.FAILURE, 1).final) == (2, False)
    assert decide(EndReason.FAILURE, 2).final and decide(EndReason.NODE_LOST, 2).final
    assert (decide(EndReason.MEMBERSHIP, 2).restarts, decide(EndReason.MEMBERSHIP, 2).final) == (2, False)
    assert decide(EndReason.SUCCESS, 0).final and decide(EndReason.NODE_LEFT, 0, final=True).final
    end = decide(EndReason.NODE_LOST, 0)
    assert RoundEnd.from_json(end.to_json()) == end
