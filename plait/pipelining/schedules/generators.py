"""The built-in schedules as pure functions: (ranks, microbatches) -> `Schedule`.

Each returns compute actions only (F, B or I/W); `lower` adds the SEND/RECV. The orders
are torch 2.x's, action for action, where torch has the schedule (tests compare them),
with one deliberate difference: for 1F1B with fewer microbatches than ranks torch's
order lists forwards of microbatches that do not exist; here warm-up stops at the last one.

Stage placement: one stage per rank for GPipe and 1F1B; loop style (stage s on rank
s % p) for the interleaved and looped schedules; V style for ZBV (rank r owns stages r
and 2p-1-r). DualPipeV, V style too, lives in `dualpipev.py`. Looped1F1B is plait's own
(torch has none): Interleaved1F1B's order with rounds of a chosen size.
"""

from __future__ import annotations

from collections.abc import Callable

from .actions import Action, B, F, I, W
from .dualpipev import dualpipe_v
from .schedule import Schedule, loop_stage_to_rank, v_stage_to_rank


def _check_sizes(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """Fill and drain: every forward, then every backward (peak in flight: m per stage)."""
    _check_sizes(num_ranks, num_microbatches)
    mbs = range(num_microbatches)
    actions = [[F(r, i) for i in mbs] + [B(r, i) for i in mbs] for r in range(num_ranks)]
    return Schedule(actions, loop_stage_to_rank(num_ranks, num_ranks), num_microbatches, "GPipe")


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B: p-1-r warm-up forwards, then one forward one backward, then the rest backward.

    Same bubble as GPipe, but rank r holds at most p-r microbatches' activations, not m.
    """
    _check_sizes(num_ranks, num_microbatches)
    actions = []
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, num_microbatches)
        ops = [F(r, i) for i in range(warmup)]
        for i in range(warmup, num_microbatches):
            ops += [F(r, i), B(r, i - warmup)]
        ops += [B(r, i) for i in range(num_microbatches - warmup, num_microbatches)]
        actions.append(ops)
    return Schedule(actions, loop_stage_to_rank(num_ranks, num_ranks), num_microbatches, "1F1B")


def looped_bfs(num_ranks: int, num_microbatches: int, *, stages_per_rank: int = 2) -> Schedule:
    """Breadth first (arXiv 2211.05953): each local stage runs all microbatches before the
    next; backwards run last stage first, microbatches in reverse."""
    _check_sizes(num_ranks, num_microbatches, stages_per_rank)
    num_stages = num_ranks * stages_per_rank
    mbs = range(num_microbatches)
    actions = []
    for r in range(num_ranks):
        stages = range(r, num_stages, num_ranks)
        ops = [F(s, i) for s in stages for i in mbs]
        ops += [B(s, i) for s in reversed(stages) for i in reversed(mbs)]
        actions.append(ops)
    return Schedule(
        actions, loop_stage_to_rank(num_ranks, num_stages), num_microbatches, "LoopedBFS"
    )


def _rounds(num_ranks: int, num_microbatches: int, schedule: str) -> int:
    """Microbatches per round: the unit in which interleaved schedules switch local stage."""
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        raise ValueError(
            f"{schedule} needs num_microbatches({num_microbatches}) to be a multiple of "
            f"its number of rounds max(1, {num_microbatches} // num_ranks({num_ranks})) = {rounds}"
        )
    return num_microbatches // rounds


def _interleaved_rank(
    rank: int,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int,
    *,
    zero_bubble: bool,
    per_round: int,
) -> list[Action]:
    """Depth-first interleaving (Megatron's) for one rank, `per_round` microbatches a round.

    Forward k goes to local stage (k // per_round) % v; backward j to the mirror image,
    last local stage first. Warm-up is enough forwards for the first backward to arrive:
    (v-1) rounds plus 2 per hop to the last rank (1 per hop with zero bubble, whose I is
    quicker to come back). With zero bubble, each I is followed by the W of the I that
    ran `rank` backwards earlier, so W fills exactly the slots where 1F1B would idle.
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    total = m * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), total)

    def fwd_stage(k: int) -> int:
        return (k // per_round) % v * p + rank

    def bwd_stage(j: int) -> int:
        return (v - 1 - (j // per_round) % v) * p + rank

    next_mb: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> int:
        mb = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = mb + 1
        return mb

    backward = B if not zero_bubble else I
    done_bwd: list[Action] = []
    weights_done = 0
    ops = [F(s, take("F", s)) for s in map(fwd_stage, range(warmup))]
    for j in range(total):
        k = warmup + j
        if k < total:
            s = fwd_stage(k)
            ops.append(F(s, take("F", s)))
        s = bwd_stage(j)
        done_bwd.append(backward(s, take("B", s)))
        ops.append(done_bwd[-1])
        if zero_bubble and j >= rank:
            ops.append(W(done_bwd[weights_done].stage, done_bwd[weights_done].microbatch))
            weights_done += 1
    if zero_bubble:
        ops += [W(a.stage, a.microbatch) for a in done_bwd[weights_done:]]
    return ops


def interleaved_1f1b(
    num_ranks: int, num_microbatches: int, *, stages_per_rank: int = 2
) -> Schedule:
    """Interleaved 1F1B (arXiv 2104.04473): v stages per rank, depth first."""
    _check_sizes(num_ranks, num_microbatches, stages_per_rank)
    per_round = _rounds(num_ranks, num_microbatches, "Interleaved1F1B")
    actions = [
        _interleaved_rank(
            r, num_ranks, num_microbatches, stages_per_rank, zero_bubble=False, per_round=per_round
        )
        for r in range(num_ranks)
    ]
    stage_to_rank = loop_stage_to_rank(num_ranks, num_ranks * stages_per_rank)
    return Schedule(actions, stage_to_rank, num_microbatches, "Interleaved1F1B")


def looped_1f1b(
    num_ranks: int,
    num_microbatches: int,
    *,
    stages_per_rank: int = 2,
    microbatches_per_round: int | None = None,
) -> Schedule:
    """Looped 1F1B: v looped stages per rank (stage s on rank s % p), 1F1B steady state,
    microbatches taken through each local stage in rounds of `microbatches_per_round` (g).

    Terms from Lamy-Poirier, "Breadth-First Pipeline Parallelism" (arXiv 2211.05953):
    "looped" is the placement, the schedule says in which order a rank visits its stages.
    - g = p (the default) is the paper's looped *depth-first* schedule, which is Megatron's
      interleaved 1F1B (arXiv 2104.04473, rounds of exactly p, m a multiple of p). For
      those sizes this is `interleaved_1f1b`, action for action (tests compare). The two
      differ in what they accept: `interleaved_1f1b` follows torch's flexible rounds
      (m < p runs one round of m; any m with m % (m // p) == 0), this refuses m % p != 0.
    - g = m takes every microbatch through a local stage before the next, as the paper's
      *breadth-first* schedule does, but keeps 1F1B's steady state: the last local stage
      alternates F and B. `looped_bfs` instead runs every forward, then every backward
      (GPipe-like: all m*v microbatch-stages in flight on every rank at once).
    - p < g < m, g a multiple of p dividing m: in between (Megatron-core's
      microbatch_group_size_per_vp_stage). Larger g: more activations, fewer stage switches.

    Unit-cost bubble for every g: (p-1)/(v*m+p-1), like Interleaved1F1B and LoopedBFS.
    Peak in flight on rank r: min(g*(v-1) + 2*(p-1-r) + 1, m*v) (the warm-up plus one).
    """
    _check_sizes(num_ranks, num_microbatches, stages_per_rank)
    p, m = num_ranks, num_microbatches
    g = p if microbatches_per_round is None else microbatches_per_round
    if g < p or g % p or m % g:
        raise ValueError(
            f"Looped1F1B takes microbatches in rounds of microbatches_per_round({g}): it must "
            f"be a multiple of num_ranks({p}) that divides num_microbatches({m}); for other "
            "sizes use Interleaved1F1B (torch's flexible rounds)"
        )
    actions = [
        _interleaved_rank(r, p, m, stages_per_rank, zero_bubble=False, per_round=g)
        for r in range(p)
    ]
    return Schedule(actions, loop_stage_to_rank(p, p * stages_per_rank), m, "Looped1F1B")


def interleaved_zero_bubble(
    num_ranks: int, num_microbatches: int, *, stages_per_rank: int = 2
) -> Schedule:
    """Zero bubble ZB-H1 (arXiv 2401.10241), interleaved over v stages per rank.

    B is split into I (input grad, on the critical path) and W (weight grad, deferred
    into what would be bubble). With stages_per_rank=1 this is plain ZB-H1.
    """
    _check_sizes(num_ranks, num_microbatches, stages_per_rank)
    per_round = _rounds(num_ranks, num_microbatches, "InterleavedZeroBubble")
    actions = [
        _interleaved_rank(
            r, num_ranks, num_microbatches, stages_per_rank, zero_bubble=True, per_round=per_round
        )
        for r in range(num_ranks)
    ]
    stage_to_rank = loop_stage_to_rank(num_ranks, num_ranks * stages_per_rank)
    return Schedule(actions, stage_to_rank, num_microbatches, "InterleavedZeroBubble")


def zbv_zero_bubble(num_ranks: int, num_microbatches: int) -> Schedule:
    """Zero bubble V (arXiv 2401.10241, section 6): rank r owns stages r and 2p-1-r.

    Bubble-free when F, I and W cost the same and m >= 2p-1. The order is built for
    max(m, 2p-1) microbatches and the surplus dropped, as torch does.
    """
    _check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    actions = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r  # going down the V, coming back up
        f0 = f1 = b0 = b1 = 0
        ops: list[Action] = []
        for _ in range(2 * (p - r) - 1):
            ops.append(F(s0, f0))
            f0 += 1
        for _ in range(r):
            ops += [F(s1, f1), F(s0, f0)]
            f1 += 1
            f0 += 1
        for _ in range(p - r):
            ops += [F(s1, f1), I(s1, b1), W(s1, b1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                ops.append(F(s0, f0))
                f0 += 1
            ops += [I(s0, b0), W(s0, b0), F(s1, f1), I(s1, b1), W(s1, b1)]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):
            ops += [I(s0, b0), I(s1, b1)]
            b0 += 1
            b1 += 1
        for _ in range(p - r):
            ops += [I(s0, b0), W(s0, w0)]
            b0 += 1
            w0 += 1
        ops += [W(s1, i) for i in range(w1, b1)]
        ops += [W(s0, i) for i in range(w0, b0)]
        assert f0 == b0 == n and f1 == b1 == n, (f0, b0, f1, b1, n)
        actions.append([a for a in ops if a.microbatch < m])
    return Schedule(actions, v_stage_to_rank(p, 2 * p), m, "ZBVZeroBubble")


# name -> (generator, takes stages_per_rank, default stages_per_rank); names as torch's
# get_schedule_class spells them, looked up case-insensitively.
SCHEDULES: dict[str, tuple[Callable[..., Schedule], bool, int]] = {
    "GPipe": (gpipe, False, 1),
    "1F1B": (one_f_one_b, False, 1),
    "Interleaved1F1B": (interleaved_1f1b, True, 2),
    "LoopedBFS": (looped_bfs, True, 2),
    "Looped1F1B": (looped_1f1b, True, 2),
    "InterleavedZeroBubble": (interleaved_zero_bubble, True, 2),
    "ZBVZeroBubble": (zbv_zero_bubble, False, 2),
    "DualPipeV": (dualpipe_v, False, 2),
}


def build_schedule(
    name: str, num_ranks: int, num_microbatches: int, *, stages_per_rank: int | None = None
) -> Schedule:
    """The built-in schedule `name` (case-insensitive, torch's names: "GPipe", "1F1B",
    "Interleaved1F1B", "LoopedBFS", "Looped1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV")."""
    by_lower = {k.lower(): k for k in SCHEDULES}
    if name.lower() not in by_lower:
        raise ValueError(f"unknown schedule {name!r}; choose from {list(SCHEDULES)}")
    key = by_lower[name.lower()]
    generate, takes_v, default_v = SCHEDULES[key]
    if takes_v:
        v = default_v if stages_per_rank is None else stages_per_rank
        return generate(num_ranks, num_microbatches, stages_per_rank=v)
    if stages_per_rank is not None and stages_per_rank != default_v:
        raise ValueError(
            f"{key} runs {default_v} stage(s) per rank, got stages_per_rank={stages_per_rank}"
        )
    return generate(num_ranks, num_microbatches)
