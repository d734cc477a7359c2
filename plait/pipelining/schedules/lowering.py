"""Lowering: insert the SEND/RECV a compute-only schedule needs, in an order that cannot hang.

    compute-only Schedule --simulate (start times)--> one global order of compute actions
        --walk it--> per rank: compute, SEND right after its producer; RECV on the peer

Contract for the runtime that executes a lowered schedule (one list per rank):

1. Run the list in order. `RECV_F s mb` posts the receive of stage s's input from the rank
   of stage s-1; `RECV_B s mb` the receive of stage s's output grad from the rank of s+1.
   The compute that consumes it (F, or B|I, of s on mb) comes later in the same list and
   must wait for that receive before it starts. `SEND_F s mb` posts F(s, mb)'s output to
   the rank of s+1, `SEND_B s mb` B|I(s, mb)'s input grad to the rank of s-1; each comes
   right after the compute that produced it.
2. Stages s and s+1 on the same rank (the V schedule's turn-around) get no SEND/RECV: the
   consumer reads the producer's result locally.
3. Between any two ranks, sends and receives are listed in the same order, so they may
   be matched by order (NCCL's p2p rule) as well as by (stage, microbatch).
4. Deadlock-free under the strictest semantics: even if every SEND/RECV is posted alone
   and blocks until its peer posts the match (rendezvous). A witness: the global order the
   lists were cut from runs every pair back to back. So a runtime may post each op as its
   own `batch_isend_irecv`, or group each run of consecutive SEND/RECV into one batch (what
   `check` assumes by default), and may wait on sends late (end of step) and on receives
   only at the consumer: each relaxation only lets ops complete earlier, and the system is
   persistent, so none can create a hang.
5. Placement follows the simulated timeline: the global order is compute actions by
   simulated start (ties: lower rank), so a RECV lands after the receiver's actions that
   start before its producer does, early enough for an asynchronous runtime to have it in
   flight before the consumer needs it.
"""

from __future__ import annotations

import heapq

from .actions import Action
from .deps import Dataflow
from .schedule import Schedule
from .simulator import Costs, simulate


def lower(schedule: Schedule, *, costs: Costs | None = None) -> Schedule:
    """Return `schedule` with SEND/RECV actions added (see the module contract).

    `schedule` must be compute-only and pass `check`. `costs` (default `Costs()`) only
    decide where receives land; every cost model gives a deadlock-free result.
    """
    if schedule.is_lowered:
        raise ValueError("schedule already has SEND/RECV actions; lower a compute-only one")
    sim = simulate(schedule, costs)
    flow = Dataflow(schedule)
    start = {slot.action: slot.start for rank in sim.timeline for slot in rank}
    acts = schedule.actions
    out: list[list[Action]] = [[] for _ in acts]
    pos = [0] * schedule.num_ranks
    done: set[Action] = set()
    queued = [False] * schedule.num_ranks
    heap: list[tuple[float, int]] = []

    def offer(r: int) -> None:
        """Queue rank r's next action if it can run now (bookkeeping always can)."""
        if queued[r] or pos[r] >= len(acts[r]):
            return
        a = acts[r][pos[r]]
        if all(p in done for p in flow.producers(a)):
            # Bookkeeping actions have no time of their own: they go with the rank's clock.
            heapq.heappush(heap, (start.get(a, float("-inf")), r))
            queued[r] = True

    for r in range(schedule.num_ranks):
        offer(r)
    while heap:  # Kahn's walk, earliest simulated start first, then lowest rank
        _, r = heapq.heappop(heap)
        queued[r] = False
        a = acts[r][pos[r]]
        pos[r] += 1
        done.add(a)
        out[r].append(a)
        carried = flow.transfers(a) if a.is_compute else None
        if carried is not None:
            send, recv = carried
            peer = schedule.stage_to_rank[recv.stage]
            out[r].append(send)
            out[peer].append(recv)
            offer(peer)
        offer(r)
    assert all(pos[r] == len(acts[r]) for r in range(len(acts))), "simulate() passed a deadlock"
    return Schedule(tuple(out), schedule.stage_to_rank, schedule.num_microbatches, schedule.name)
