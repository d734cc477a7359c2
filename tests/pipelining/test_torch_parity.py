"""Same orders as torch.distributed.pipelining, and each side accepts the other's lowering.

torch's schedule classes want PipelineStage objects; a stand-in with the few attributes
their constructors read is enough to make them compute their orders, no process needed.
"""

import csv

import pytest

pipelining = pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining._utils import (  # noqa: E402
    generate_rank_to_stage_mapping,
    generate_stage_to_rank_mapping,
)

from plait.pipelining.schedules import (  # noqa: E402
    Schedule,
    ScheduleError,
    build_schedule,
    check,
    load_csv,
    lower,
    schedule_to_csv,
)


class _StageStandIn:
    def __init__(self, stage_index: int, num_stages: int, group_size: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, 0
        self.submod = None


def _torch_schedule(name: str, p: int, m: int, v: int):
    cls = torch_schedules.get_schedule_class(name)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return cls(_StageStandIn(0, p, p), m)
    style = "v" if name in V_STYLE else "loop"
    stages = generate_rank_to_stage_mapping(p, p * v, style)[0]
    return cls([_StageStandIn(s, p * v, p) for s in stages], m)


V_STYLE = ("ZBVZeroBubble", "DualPipeV")


def _flat(action) -> list:
    """torch's OVERLAP_F_B as its sub-actions, in the order torch's runtime runs them."""
    return list(action.sub_actions) if action.sub_actions is not None else [action]


def _torch_compute_order(name: str, p: int, m: int, v: int) -> list[list[str]]:
    order = _torch_schedule(name, p, m, v).pipeline_order
    return [
        [
            str(a)
            for action in order[r]
            if action is not None
            for a in _flat(action)
            if a.computation_type.value in "FBIW"
        ]
        for r in range(p)
    ]


MULTI = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]
SIZES = [(p, m) for p in range(2, 9) for m in (p, 2 * p, 4 * p)]
FEWER_SIZES = [(p, m) for p, m in SIZES if p in (2, 3, 4, 8)]  # where torch's side is slow


@pytest.mark.parametrize("p, m", SIZES)
def test_single_stage_and_v_orders_equal_torchs(p, m):
    for name in ("GPipe", "ZBVZeroBubble"):
        v = 2 if name == "ZBVZeroBubble" else 1
        assert build_schedule(name, p, m).to_lists() == _torch_compute_order(name, p, m, v)


@pytest.mark.parametrize("p, m", [(p, m) for p in range(2, 9) for m in (2 * p, 4 * p)])
def test_dualpipev_order_equals_torchs(p, m):
    torch_order = _torch_schedule("DualPipeV", p, m, 2).pipeline_order
    overlapped = sum(a.sub_actions is not None for r in range(p) for a in torch_order[r])
    assert overlapped > 0  # torch's pairs are in the list we flatten
    assert build_schedule("DualPipeV", p, m).to_lists() == _torch_compute_order(
        "DualPipeV", p, m, 2
    )


@pytest.mark.parametrize("name", MULTI)
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_orders_equal_torchs(name, v):
    for p, m in SIZES if v == 2 else FEWER_SIZES:
        ours = build_schedule(name, p, m, stages_per_rank=v)
        assert ours.to_lists() == _torch_compute_order(name, p, m, v), (name, p, m, v)


@pytest.mark.parametrize("p, m", SIZES)
def test_1f1b_equals_torchs_except_torchs_broken_last_rank(p, m):
    ours, theirs = build_schedule("1F1B", p, m).to_lists(), _torch_compute_order("1F1B", p, m, 1)
    assert ours[:-1] == theirs[:-1]
    # torch's Schedule1F1B._get_pipeline_order starts the last rank at F1 and runs a
    # forward of microbatch m, which does not exist (its runtime, _step_microbatches,
    # runs F0 B0 F1 B1 ... like ours). The checker catches it.
    assert theirs[-1][0] == f"{p - 1}F1" and ours[-1][0] == f"{p - 1}F0"
    with pytest.raises(ScheduleError, match=f"microbatch {m} does not exist"):
        check(Schedule.from_lists(theirs, num_microbatches=m))


@pytest.mark.parametrize("name", [*MULTI, *V_STYLE])
def test_torchs_lowering_passes_our_checker(name):
    for p, m in FEWER_SIZES:
        m = max(m, 2 * p) if name == "DualPipeV" else m
        v = 2
        lowered = _torch_schedule(name, p, m, v).pipeline_order_with_comms
        schedule = Schedule.from_lists([[str(a) for a in lowered[r]] for r in range(p)])
        check(schedule, batch_comms=False)


@pytest.mark.parametrize("name", [*MULTI, *V_STYLE])
def test_our_lowering_passes_torchs_simulator(name):
    for p, m in FEWER_SIZES:
        m = max(m, 2 * p) if name == "DualPipeV" else m
        v = 2
        style = "v" if name in V_STYLE else "loop"
        stage_to_rank = generate_stage_to_rank_mapping(p, p * v, style=style)
        ours = lower(build_schedule(name, p, m))
        assert ours.stage_to_rank == tuple(stage_to_rank[s] for s in range(p * v))
        order = {
            r: [torch_schedules._Action.from_str(a) for a in row]
            for r, row in enumerate(ours.to_lists())
        }
        torch_schedules._simulate_comms_compute(order, stage_to_rank.__getitem__, p * v)


def test_csv_interchange_with_torch(tmp_path):
    torch_sched = _torch_schedule("Interleaved1F1B", 4, 8, 2)
    path = tmp_path / "torch.csv"
    torch_sched._dump_csv(str(path), format="compute_comms")  # with UNSHARD, REDUCE_GRAD, ...
    theirs = load_csv(path)
    check(theirs)
    assert theirs.to_lists() == [
        [str(a) for a in torch_sched.pipeline_order_with_comms[r]] for r in range(4)
    ]

    ours = build_schedule("Interleaved1F1B", 4, 8)
    rows = list(csv.reader(schedule_to_csv(ours).splitlines()))
    assert [[str(torch_schedules._Action.from_str(c)) for c in row] for row in rows] == (
        ours.to_lists()
    )
    mine = tmp_path / "ours.csv"
    mine.write_text(schedule_to_csv(ours))
    torch_sched._load_csv(str(mine), format="compute_only")  # torch validates and lowers it
