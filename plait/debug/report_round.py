"""One verdict per hang: the first rank to time out decides it, every other rank reads it,
and nobody leaves the store while a peer still reads it.

    a rank whose op timed out (fire)          a rank asked for its state (respond)
      state/<me>                                state/<me>
      claim desync/request ─ won ─▶ collect state/<r> (bounded) ─▶ verdict ─▶ desync/report
                       └── lost ─▶ wait for desync/report (bounded)   wait for desync/report (bounded)
      print, dump ─▶ desync/done/<me> ─▶ wait for desync/done/<r> of every rank still reading (bounded) ─▶ exit

Why a round: the store lives in one rank's process unless a launcher hosts it (plait run
and torchrun do; a job started by hand with MASTER_ADDR does not, rank 0 serves it). Two
ranks can time out at once; if each gathered states and decided on its own, the one that
finished first would exit, take the store with it, and leave the other with "side channel
failed" and an undecided verdict. So the claim (a compare-and-set) makes one rank the
reporter; the others print its verdict, and every rank that took part waits (bounded) for
the others' done before it exits — the store's host among them, whichever rank that is.

Every wait is bounded: a rank that died never holds the others for longer than the bound,
and a reporter that dies before publishing leaves its followers to decide alone.
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from plait.debug import channel
from plait.debug.desync import EXITED, FAILED, IN_OP, RUNNING

REQUEST, REPORT = "desync/request", "desync/report"


def state_key(rank: int) -> str:
    return f"state/{rank}"


def done_key(rank: int) -> str:
    return f"desync/done/{rank}"


def claim(store: dist.Store, request: dict, *, born_ns: int) -> dict:
    """Make `request` the round's request unless another rank's holds; return the one that holds.

    A request older than this session (`born_ns`) was left in the store by an earlier
    session of the same job and is replaced, with the report it may have had.
    """
    mine = json.dumps(request)
    held = store.compare_set(REQUEST, "", mine).decode()
    current = json.loads(held)
    if held != mine and current["time_ns"] < born_ns:
        store.delete_key(REPORT)
        held = store.compare_set(REQUEST, held, mine).decode()
        current = json.loads(held)
    return current


def pending_request(store: dist.Store, *, born_ns: int) -> dict | None:
    """The round's request, if a peer made one during this session."""
    if not store.check([REQUEST]):
        return None
    request = channel.get_json(store, [REQUEST])[0]
    return request if request["time_ns"] >= born_ns else None


def collect(store: dist.Store, me: int, world_size: int, wait_s: float) -> dict[int, dict | None]:
    """Every other rank's state, waiting at most `wait_s` for those not there yet."""
    others = [r for r in range(world_size) if r != me]
    keys = [state_key(r) for r in others]
    channel.wait(store, keys, wait_s)
    present = channel.present(store, keys)
    found = [k for k, p in zip(keys, present) if p]
    states: dict[int, dict | None] = {r: None for r in others}
    for key, state in zip(found, channel.get_json(store, found)):
        states[int(key.rsplit("/", 1)[1])] = state
    return states


def publish(store: dist.Store, *, rank: int, op: str, text: str, verdict: dict,
            states: dict[int, dict | None]) -> None:
    channel.put_json(store, REPORT, {"rank": rank, "op": op, "text": text, "verdict": verdict,
                                     "states": {str(r): s for r, s in states.items()}})


def await_report(store: dist.Store, wait_s: float) -> dict | None:
    """The reporter's published report, or None if none came within `wait_s`."""
    if not channel.wait(store, [REPORT], wait_s):
        return None
    report = channel.get_json(store, [REPORT])[0]
    report["states"] = {int(r): s for r, s in report["states"].items()}
    return report


def still_reading(states: dict[int, dict | None], me: int) -> list[int]:
    """Ranks that took part in the round (they published a live state) and may still read the store.

    A rank that exited or failed before the round reads nothing more; one that never
    answered is not waited for (it may be dead: the report already says "no answer").
    """
    return sorted(r for r, s in states.items() if r != me and s is not None and s.get("status") in (RUNNING, IN_OP))


def leave(store: dist.Store, me: int, peers: list[int], wait_s: float) -> list[int]:
    """Say this rank is done with the store, then wait (bounded) until `peers` are too.

    Returns the peers that did not finish in time."""
    store.set(done_key(me), str(time.time_ns()))
    keys = [done_key(r) for r in peers]
    if channel.wait(store, keys, wait_s):
        return []
    return [r for r, p in zip(peers, channel.present(store, keys)) if not p]


def unfinished(store: dist.Store, me: int, world_size: int) -> list[int]:
    """Peers that may still need the store: neither ended (exited, failed) nor done with a report."""
    out = []
    for r in range(world_size):
        if r == me or store.check([done_key(r)]):
            continue
        state = channel.get_json(store, [state_key(r)])[0] if store.check([state_key(r)]) else None
        if state is None or state.get("status") not in (EXITED, FAILED):
            out.append(r)
    return out
