"""Check a schedule before anything runs: no processes, no tensors.

    placement -> local order -> completeness -> messages (lowered only) -> deadlock

Each stage raises `ScheduleError` naming the first bad action (lowest rank, then earliest
position) and its rank, so a user fixing a CSV knows which cell to look at.

Deadlock is decided by running the schedule on blocking semantics, which is sound for
every timing: ranks are sequential and each waits on one fixed event, so a wait that can
be met stays met (the system is persistent) and one complete run proves all runs finish.

- Compute only: an action waits until the actions it reads (`deps.Dataflow`) have run.
- Lowered: compute never waits (its inputs are local or RECVed before it, checked
  earlier); communication is a rendezvous. With `batch_comms=True` (the runtime contract,
  see `lowering`) each maximal run of consecutive SEND/RECV on a rank is posted together
  and completes when every op in it meets its peer; with `batch_comms=False` each op is
  its own batch, the stricter model that `lower`'s output also satisfies.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .actions import Action, ActionType
from .deps import Dataflow
from .schedule import Schedule, ScheduleError

_SEND_TO_RECV = {ActionType.SEND_F: ActionType.RECV_F, ActionType.SEND_B: ActionType.RECV_B}
_RECV_TO_SEND = {v: k for k, v in _SEND_TO_RECV.items()}
_F, _B, _I, _W = ActionType.F, ActionType.B, ActionType.I, ActionType.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = (
    ActionType.SEND_F,
    ActionType.RECV_F,
    ActionType.SEND_B,
    ActionType.RECV_B,
)
_COMPUTE_KINDS = frozenset({_F, _B, _I, _W})
# Membership tests look Actions up with plain tuples (equal and hashed alike), far cheaper
# to build; Actions are made only for error messages.


@dataclass(frozen=True)
class CheckReport:
    """What a passing check verified."""

    num_ranks: int
    num_stages: int
    num_microbatches: int
    num_compute: int
    num_messages: int
    lowered: bool

    def __str__(self) -> str:
        comms = (
            f"{self.num_messages} sends each matched by its receive in order; "
            if self.lowered
            else ""
        )
        return (
            f"OK: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches, {self.num_compute} compute actions; "
            "every microbatch runs F then B (or I then W) once on every stage; "
            f"{comms}no deadlock"
        )


def matching(action: Action) -> Action:
    """The other end of a comm action: SEND_F(s) <-> RECV_F(s+1), SEND_B(s) <-> RECV_B(s-1)."""
    kind = _SEND_TO_RECV.get(action.kind) or _RECV_TO_SEND[action.kind]
    return Action._make((action.peer_stage, kind, action.microbatch))


def check(schedule: Schedule, *, batch_comms: bool = True) -> CheckReport:
    """Raise `ScheduleError` unless `schedule` (compute only or lowered) can run.

    Checks that every action's stage lives on its rank, every microbatch runs F then B
    (or I then W) exactly once on every stage in dependency order, every SEND has its
    RECV (and in the same order between each pair of ranks, as p2p messages match by
    order), and that no set of ranks waits on each other in a cycle.
    """
    flow = Dataflow(schedule)
    _check_placement(schedule)
    _check_local_order(schedule, flow)
    where = _locate(schedule)
    _check_complete(schedule, where)
    num_messages = 0
    if schedule.is_lowered:
        num_messages = _check_messages(schedule, flow, where)
        _run_rendezvous(schedule, batch_comms)
    else:
        _run_dataflow(schedule, flow)
    return CheckReport(
        schedule.num_ranks,
        schedule.num_stages,
        schedule.num_microbatches,
        sum(a.is_compute for acts in schedule.actions for a in acts),
        num_messages,
        schedule.is_lowered,
    )


def _check_placement(schedule: Schedule) -> None:
    """Every action names an existing stage of its own rank and an existing microbatch."""
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            problem = _misplaced(schedule, rank, a)
            if problem is not None:
                raise ScheduleError(problem, rank=rank, index=i, action=a)


def _misplaced(schedule: Schedule, rank: int, a: Action) -> str | None:
    n, m, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    if a.stage >= n:
        return f"stage {a.stage} does not exist: the schedule has {n} stages"
    if owner[a.stage] != rank:
        return f"stage {a.stage} belongs to rank {owner[a.stage]}, not rank {rank}"
    if a.microbatch is not None and a.microbatch >= m:
        return f"microbatch {a.microbatch} does not exist: num_microbatches is {m}"
    if a.is_comm:
        peer = a.peer_stage
        if not 0 <= peer < n:
            return f"there is no stage {peer} at the other end of {a.kind.value}"
        if owner[peer] == rank:
            return f"stage {peer} is on this rank too: a local transfer needs no {a.kind.value}"
    return None


def _check_local_order(schedule: Schedule, flow: Dataflow) -> None:
    """Per rank: nothing twice, F before B|I before W, local inputs before use, SEND after."""
    owner = schedule.stage_to_rank
    for rank, acts in enumerate(schedule.actions):
        seen: set[tuple] = set()
        for i, a in enumerate(acts):
            s, kind, mb = a
            if mb is None:  # bookkeeping (UNSHARD, RESHARD, REDUCE_GRAD)
                continue
            problem = None
            if a in seen:
                problem = f"{a} runs twice on this rank"
            elif (kind is _B and (s, _I, mb) in seen) or (kind is _I and (s, _B, mb) in seen):
                problem = f"stage {s} already ran a backward for microbatch {mb}: B or I, not both"
            elif kind is _W and (s, _B, mb) in seen:
                problem = f"{Action(s, _B, mb)} already computed this weight grad"
            elif kind in _COMPUTE_KINDS:
                for needed in flow.producers(a):
                    if owner[needed[0]] == rank and needed not in seen:
                        problem = f"runs before {needed}, which it reads and which is on this rank"
                        break
            elif kind is _SEND_F and (s, _F, mb) not in seen:
                problem = f"sends before {Action(s, _F, mb)} has computed it"
            elif kind is _SEND_B and (s, _B, mb) not in seen and (s, _I, mb) not in seen:
                problem = f"sends before {flow.backward(s, mb)} has computed it"
            if problem is not None:
                raise ScheduleError(problem, rank=rank, index=i, action=a)
            seen.add(a)


def _locate(schedule: Schedule) -> dict[tuple, tuple[int, int]]:
    return {a: (r, i) for r, acts in enumerate(schedule.actions) for i, a in enumerate(acts)}


def _check_complete(schedule: Schedule, where: dict[tuple, tuple[int, int]]) -> None:
    """Every stage runs F and then B (or I and W) for every microbatch."""
    for s in range(schedule.num_stages):
        owner = schedule.stage_to_rank[s]
        for mb in range(schedule.num_microbatches):
            if (s, _F, mb) not in where:
                f = Action(s, _F, mb)
                raise ScheduleError(
                    f"missing {f}: stage {s} never runs the forward of microbatch {mb}",
                    rank=owner,
                    action=f,
                )
            if (s, _B, mb) not in where and (s, _I, mb) not in where:
                f, b, i, w = (Action(s, k, mb) for k in (_F, _B, _I, _W))
                raise ScheduleError(
                    f"missing {b}: stage {s} runs {f} (action #{where[f][1]}) but never its "
                    f"backward {b} (or {i} and {w})",
                    rank=owner,
                    action=b,
                )
            if (s, _I, mb) in where and (s, _W, mb) not in where:
                i, w = Action(s, _I, mb), Action(s, _W, mb)
                raise ScheduleError(
                    f"missing {w}: {i} (action #{where[i][1]}) is never followed by its "
                    "weight grad",
                    rank=owner,
                    action=w,
                )


def _message(a: tuple) -> tuple[str, int, int]:
    """(direction, sending stage, microbatch): what a SEND and its RECV both name."""
    s, kind, mb = a
    if kind is _SEND_F:
        return "F", s, mb
    if kind is _SEND_B:
        return "B", s, mb
    if kind is _RECV_F:
        return "F", s - 1, mb
    return "B", s + 1, mb


def _check_messages(schedule: Schedule, flow: Dataflow, where: dict[tuple, tuple[int, int]]) -> int:
    """Every SEND has its RECV and vice versa, in the same order on each rank pair, and
    every cross-rank input is carried: SEND after its producer, RECV before its consumer."""
    owner = schedule.stage_to_rank
    channels: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if not a.is_comm:
                continue
            other = matching(a)
            peer = owner[other.stage]
            if other not in where:
                raise ScheduleError(
                    f"{a} has no matching {other} on rank {peer}", rank=rank, index=i, action=a
                )
            is_send = a.kind in _SEND_TO_RECV
            channel = (rank, peer) if is_send else (peer, rank)
            channels[channel][0 if is_send else 1].append((i, a))
    for (src, dst), (sends, recvs) in sorted(channels.items()):
        for k, ((i, send), (_, recv)) in enumerate(zip(sends, recvs)):
            if _message(send) != _message(recv):
                raise ScheduleError(
                    f"{send} is message #{k} from rank {src} to rank {dst}, but rank {dst}'s "
                    f"receive #{k} from rank {src} is {recv}, not {matching(send)}: p2p "
                    "messages between two ranks match in the order they are posted",
                    rank=src,
                    index=i,
                    action=send,
                )
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if not a.is_compute:
                continue
            carried = flow.transfers(a)
            if carried is not None and carried[0] not in where:
                send, recv = carried
                raise ScheduleError(
                    f"its result goes to stage {recv.stage} on rank {owner[recv.stage]}, "
                    f"but no {send} / {recv} carries it",
                    rank=rank,
                    index=i,
                    action=a,
                )
            recv = flow.received_input(a)
            if recv is not None and where[recv][1] > i:
                raise ScheduleError(
                    f"runs before {recv} (action #{where[recv][1]}) receives its input",
                    rank=rank,
                    index=i,
                    action=a,
                )
    return sum(len(sends) for sends, _ in channels.values())


def _run_dataflow(schedule: Schedule, flow: Dataflow) -> None:
    """Run a compute-only schedule: each action waits for its producers, on any rank."""
    acts, done = schedule.actions, set()
    pos = [0] * schedule.num_ranks
    progress = True
    while progress:
        progress = False
        for r in range(schedule.num_ranks):
            while pos[r] < len(acts[r]) and all(p in done for p in flow.producers(acts[r][pos[r]])):
                done.add(acts[r][pos[r]])
                pos[r] += 1
                progress = True
    waits = {}
    for r in range(schedule.num_ranks):
        if pos[r] < len(acts[r]):
            a = acts[r][pos[r]]
            missing = next(p for p in flow.producers(a) if p not in done)
            waits[r] = (pos[r], a, missing, schedule.stage_to_rank[missing.stage])
    _raise_cycle(waits)


def _run_rendezvous(schedule: Schedule, batch_comms: bool) -> None:
    """Run a lowered schedule: SEND and RECV block until both ends are posted."""
    acts, owner = schedule.actions, schedule.stage_to_rank
    # Per rank, the message each comm action names (None for compute and bookkeeping).
    keys = [[_message(a) if a.is_comm else None for a in rank_acts] for rank_acts in acts]
    pos = [0] * schedule.num_ranks
    batch_end = [0] * schedule.num_ranks  # end of the batch rank r has posted
    pending = [0] * schedule.num_ranks  # its messages whose other end is not posted yet
    first_end: dict[tuple[str, int, int], int] = {}  # message -> rank that posted it first
    unblocked: list[int] = []

    def run(r: int) -> None:
        """Advance rank r until it posts a batch some of whose messages lack their peer."""
        rank_keys, n = keys[r], len(keys[r])
        while True:
            while pos[r] < n and rank_keys[pos[r]] is None:
                pos[r] += 1
            if pos[r] == n:
                return
            end = pos[r] + 1
            while batch_comms and end < n and rank_keys[end] is not None:
                end += 1
            batch_end[r] = end
            for k in range(pos[r], end):
                other = first_end.pop(rank_keys[k], None)
                if other is None:
                    first_end[rank_keys[k]] = r
                    pending[r] += 1
                else:  # the peer posted it first and now has one fewer to wait for
                    pending[other] -= 1
                    if pending[other] == 0:
                        unblocked.append(other)
            if pending[r]:
                return
            pos[r] = end

    for r in range(schedule.num_ranks):
        run(r)
    while unblocked:
        r = unblocked.pop()
        pos[r] = batch_end[r]
        run(r)
    waits = {}
    for r, rank_keys in enumerate(keys):
        if pos[r] < len(rank_keys):
            i = next(k for k in range(pos[r], batch_end[r]) if rank_keys[k] in first_end)
            other = matching(acts[r][i])
            waits[r] = (i, acts[r][i], other, owner[other.stage])
    _raise_cycle(waits)


def _raise_cycle(waits: dict[int, tuple[int, Action, Action, int]]) -> None:
    """waits[rank] = (index, blocked action, awaited action, awaited rank); raise if any."""
    if not waits:
        return
    path, r = [], min(waits)
    while r in waits and r not in path:
        path.append(r)
        r = waits[r][3]
    if r not in waits:  # waits on a rank that finished without the awaited action
        i, a, other, peer = waits[path[-1]]
        raise ScheduleError(
            f"waits for {other}, but rank {peer} finished without it",
            rank=path[-1],
            index=i,
            action=a,
        )
    cycle = path[path.index(r) :]
    start = cycle.index(min(cycle))
    cycle = cycle[start:] + cycle[:start]
    links = "; ".join(
        f"rank {q} at {waits[q][1]} (#{waits[q][0]}) waits for {waits[q][2]} on rank {waits[q][3]}"
        for q in cycle
    )
    i, a, _, _ = waits[cycle[0]]
    raise ScheduleError(
        f"deadlock, ranks wait in a cycle: {links}", rank=cycle[0], index=i, action=a
    )
