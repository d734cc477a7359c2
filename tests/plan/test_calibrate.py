"""The calibration probe and its cache, and the step time's use of per-call costs measured at the
job's process count (pure logic, but for one small forked probe)."""

from __future__ import annotations

import json
import math

import pytest

from plait.plan import calibrate as cal
from plait.plan import probe
from plait.plan.hardware import Hardware
from plait.plan.timing import step_time
from plait.plan.traffic import bytes_per_step, calls_per_step
from plait.train.config import apply_overrides, load
from plait.train.layout import check


def test_group_sizes_are_the_divisors_a_layout_can_use():
    assert probe.group_sizes(8) == [2, 4, 8]
    assert probe.group_sizes(6) == [2, 3, 6]
    assert probe.group_sizes(1) == []


def test_probe_reports_a_cost_per_call_and_a_bandwidth_per_group_size_and_tp_factors():
    """4 forked processes, two rounds of two calls per variant, then tiny's TP steps: the shape of
    what it reports, and figures a machine can give (a call costs something and under a second;
    bytes move; a TP rank's step takes time)."""
    args, _ = check(load("tiny"), 1)
    table, dtensor_op_s, factors, contention = cal.collective_costs(4, budget_s=60.0, repeats=2, tp=(args, 2, 32))
    assert 1.0 <= contention < 100
    assert sorted(table) == [2, 4]
    for call, bandwidth in table.values():
        assert 0.0 <= call < 1.0 and bandwidth > 0
    assert 0.0 < dtensor_op_s < 0.1
    degrees = probe.tp_degrees(args, 4)
    assert degrees and sorted(factors) == sorted([f"tp:{g},{sp}" for g in degrees for sp in (0, 1)]
                                                 + [f"{key}:{g},{sp}" for key in ("tpddp", "tpfsdp")
                                                    for g in degrees if g < 4 for sp in (0, 1)]
                                                 + [f"cp:{c}" for c in probe.cp_degrees(32, 4)]
                                                 + [f"fsdp:{g}" for g in (2, 4)] + ["p2p"])
    assert 0.0 <= factors.pop("p2p") < 1.0  # a send or a receive: costs something and under a second
    assert all(math.isfinite(f) and f > 0 for f in factors.values()), factors


def test_tp_probe_shape_is_a_tp_rank_s_tokens():
    """A rank of tp g and dp N/g holds batch * g sequences (batch: the global batch over N), the
    sequence a multiple of g (sequence parallel splits it), at most TP_TOKENS tokens."""
    args, _ = check(load("small"), 1)
    assert probe._tp_shape(args, 2, 128, 2) == (4, 128)
    assert probe._tp_shape(args, 2, 128, 8) == (16, 128)
    b, s = probe._tp_shape(args, 64, 4096, 2)
    assert s == probe.TP_TOKENS and b == 1
    assert probe._tp_shape(args, 1, 5, 4) == (4, 4)
    assert probe.tp_degrees(args, 8) == [2, 4]  # small: 8 heads, 4 KV heads


@pytest.fixture
def fake_probe(monkeypatch, tmp_path):
    """The probe's measurements replaced by fixed figures: what calibrate caches and reads back."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    runs = []

    def costs(nproc, **kw):
        runs.append(nproc)
        return {g: (1e-3 * g, 1e8 / g) for g in probe.group_sizes(nproc)}, 2e-5, {"tp:2,1": 3.0, "tp:2,0": 2.5, "tpddp:2,1": 3.5, "tpfsdp:2,0": 3.25,
                                                                            "cp:2": 1.5, "fsdp:4": 1.75, "p2p": 7e-4}, 1.25

    monkeypatch.setattr(cal, "collective_costs", costs)
    monkeypatch.setattr(cal, "block_costs", lambda args, **kw: (5e-6, 4e10, 1.5))
    return runs


def test_calibration_is_cached_per_process_count(fake_probe, tmp_path):
    args, _ = check(load("tiny"), 1)
    hw8 = cal.calibrate(args, batch=2, seq_len=32, nproc=8)
    assert hw8.nproc == 8 and hw8.collectives == ((2, 2e-3, 5e7), (4, 4e-3, 2.5e7), (8, 8e-3, 1.25e7))
    assert (hw8.op_s, hw8.flop_rate, hw8.dtensor_op_s, hw8.ac_factor) == (5e-6, 4e10, 2e-5, 1.5)
    assert (hw8.latency, hw8.bandwidth) == (2e-3, 5e7)  # the smallest group's
    assert hw8.tp_factors == ((2, False, 2.5), (2, True, 3.0)) and hw8.cp_factors == ((2, 1.5),)
    assert hw8.tp_ddp_factors == ((2, True, 3.5),) and cal.cached(8).tp_ddp_factors == hw8.tp_ddp_factors
    assert hw8.tp_fsdp_factors == ((2, False, 3.25),) and cal.cached(8).tp_fsdp_factors == hw8.tp_fsdp_factors
    assert hw8.fsdp_factors == ((4, 1.75),) and cal.cached(8).fsdp_factors == hw8.fsdp_factors
    assert hw8.contention == 1.25 and hw8.p2p == 7e-4 and cal.cached(8).p2p == 7e-4
    assert cal.cached(8).tp_factors == hw8.tp_factors and cal.cached(8).contention == 1.25
    hw4 = cal.calibrate(args, batch=2, seq_len=32, nproc=4)
    assert fake_probe == [8, 4]
    assert cal.cached(8).collectives == hw8.collectives and cal.cached(4).collectives == hw4.collectives
    assert cal.cached(2) is None  # never measured at 2 processes
    assert cal.calibrate(args, batch=2, seq_len=32, nproc=8, refresh=False).collectives == hw8.collectives
    assert fake_probe == [8, 4]  # read from the cache, not measured again
    stored = json.loads((tmp_path / "plan-calibration.json").read_text())
    assert sorted(stored) == ["4", "8"]


def test_an_earlier_flat_cache_is_not_read_as_a_process_count(fake_probe, tmp_path):
    (tmp_path / "plan-calibration.json").write_text(json.dumps(Hardware().as_dict()))
    assert cal.cached(8) is None


def test_collective_cost_comes_from_the_table_at_its_process_count():
    hw = Hardware(latency=1e-4, bandwidth=1e9, nproc=8, collectives=((2, 1e-3, 3e8), (8, 4e-3, 1e8)))
    assert hw.collective(2, 8) == (1e-3, 3e8)
    assert hw.collective(4, 8) == (4e-3, 1e8)  # not measured: the next larger group's
    assert hw.collective(4, 4) == pytest.approx((3e-4, 1e9))  # another process count: 2-rank latency x (g-1) ring steps


def test_step_time_charges_each_call_and_byte_where_measured():
    """FSDP over 4 ranks on 2 cores, calibrated at 4 processes: each axis' comm is its bytes over
    the group's bandwidth plus its calls times the group's cost per call, all of it exposed."""
    config = apply_overrides(load("tiny"), ["--parallel.dp_shard", "4"])
    args, dims = check(config, 4)
    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    traffic, calls = bytes_per_step(args, dims, **kw), calls_per_step(args, dims, **kw)
    assert calls == {"dp_shard": 3 * 2 + 2 + 3}  # 2 blocks: 2 gathers + 1 scatter; root: 1 + 1; 3 scalars
    hw = Hardware(cores=2, nproc=4, collectives=((2, 1e-3, 3e8), (4, 2e-3, 1e8)))
    st = step_time(args, dims, traffic, hw, **kw)
    assert st.comm_s["dp_shard"] == pytest.approx(traffic["dp_shard"] / 1e8 + 11 * 2e-3)
    assert st.exposed_s == pytest.approx(sum(st.comm_s.values()))
    assert st.step_s == pytest.approx(st.compute_s + st.exposed_s)


def test_host_ops_count_the_wrappers_own():
    """FSDP's ops per group and CP's per layer add to a step's host time; DDP's per parameter."""
    from plait.plan.timing import FSDP_OPS_PER_GROUP, cp_ops, host_ops, step_ops

    def dims_of(world, overrides):
        return check(apply_overrides(load("tiny"), overrides), world)

    args, single = dims_of(1, [])
    _, fsdp = dims_of(2, ["--parallel.dp_shard", "2"])
    _, ddp = dims_of(2, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"])
    _, cp = dims_of(2, ["--parallel.dp_shard", "1", "--parallel.cp", "2"])
    base_plain, base_dt = step_ops(args, single, [0])
    assert base_dt == 0
    plain, dt = step_ops(args, fsdp, [0])
    assert plain + dt == base_plain + FSDP_OPS_PER_GROUP * 3  # 2 blocks and the root
    assert dt > 0  # the optimizer's ops on DTensor parameters
    assert sum(step_ops(args, ddp, [0])) > base_plain
    kw = dict(ac_mode="none", ac_every=2)
    assert host_ops(args, cp, 0, **kw)[0] == host_ops(args, single, 0, **kw)[0] + 2 * cp_ops(2)
    assert cp_ops(2) == 415 and cp_ops(4) == 661 and cp_ops(1) == 0  # counted: S4 C2 and S2 C4 less S8, a layer


def test_block_costs_measure_the_checkpointed_block_against_the_plain_one():
    """tiny's block at 2 x 32 tokens: three positive, finite figures. Their sizes are CPU
    timings (the checkpointed block measured ~1.5x the plain one, quiet) and are not asserted:
    under a busy machine the ratio of two short timings moved outside (1, 3) in a suite run."""
    args, _ = check(load("tiny"), 1)
    figures = cal.block_costs(args, batch=2, seq_len=32, budget_s=1.0)
    assert all(math.isfinite(x) and x > 0 for x in figures), figures


def test_a_measured_checkpoint_factor_scales_the_checkpointed_blocks():
    config = apply_overrides(load("tiny"), ["--parallel.dp_shard", "2"])
    args, dims = check(config, 2)
    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    plain = step_time(args, dims, {}, Hardware(ac_factor=2.0), ac_mode="none", **kw)
    full = step_time(args, dims, {}, Hardware(ac_factor=2.0), ac_mode="full", **kw)
    counted = step_time(args, dims, {}, Hardware(), ac_mode="full", **kw)
    assert full.compute_s > counted.compute_s > plain.compute_s  # x2 measured against x8/6 and x1.59 counted


def _step_ops_s(args, dims, hw) -> float:
    """The once-a-step ops' host seconds of rank 0, unstretched."""
    from plait.plan.shapes import stages_of
    from plait.plan.timing import step_ops

    plain, dt = step_ops(args, dims, stages_of(dims, 0))
    return plain * hw.op_s + dt * hw.dtensor_op_s


def test_a_measured_tp_factor_times_the_plain_model_and_holds_the_tp_collectives():
    """R2 T2 on 4 processes, calibrated there: a microbatch costs the TP factor times the plain
    model's compute at the rank's tokens (FLOPs unsharded, plain ops) as the 4 ranks on 2 cores
    take it (stretched 2x, times the contention measured there), and the tp axis' calls and
    bytes, which the probe's TP steps held, are not charged again; measured at another process
    count, neither figure is used."""
    import dataclasses

    from plait.plan.timing import host_ops, stage_flops_per_token

    config = apply_overrides(load("tiny"), ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                                            "--parallel.tp", "2"])
    args, dims = check(config, 4)
    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    traffic = bytes_per_step(args, dims, **kw)
    assert traffic["tp"] > 0
    hw = Hardware(cores=2, nproc=4, collectives=((2, 1e-3, 3e8), (4, 2e-3, 1e8)), tp_factors=((2, True, 3.0),),
                  contention=1.25)
    assert hw.tp_factor(2, True, 4) == 3.0 and hw.tp_factor(2, False, 4) == 0.0 and hw.tp_factor(2, True, 8) == 0.0
    st = step_time(args, dims, traffic, hw, **kw)
    assert "tp" not in st.comm_s and "dp_replicate" in st.comm_s
    plain, opts = dataclasses.replace(dims, tp=1), dict(ac_mode="none", ac_every=2)
    tokens = 8 // 2 * 32  # a rank's: the batch over dp, whole sequences
    stretch = 2 * 1.25  # 4 ranks on 2 cores, and the contention among them
    mb = 3.0 * stretch * (tokens * stage_flops_per_token(args, plain, 0, seq_len=32, **opts) / hw.flop_rate
                          + host_ops(args, plain, 0, **opts)[0] * hw.op_s)
    assert st.compute_s == pytest.approx(mb + stretch * _step_ops_s(args, dims, hw))
    other = step_time(args, dims, traffic, dataclasses.replace(hw, nproc=8), **kw)
    assert "tp" in other.comm_s  # measured at 8 processes, not 4: charged per call and byte


def test_r_x_t_takes_the_factor_measured_under_replicate_and_holds_the_dp_reduction():
    """R2 T2 on 4 processes with the probe's R x T factor (TP under replicate over the other 2):
    a microbatch costs that factor, and neither the dp_replicate axis nor DDP's own ops are
    charged again (the probe's step held them); S2 T2 is not R x T and keeps the TP factor and
    its dp_shard traffic."""
    import dataclasses

    config = apply_overrides(load("tiny"), ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                                            "--parallel.tp", "2"])
    args, dims = check(config, 4)
    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    traffic = bytes_per_step(args, dims, **kw)
    tp_only = Hardware(cores=2, nproc=4, collectives=((2, 1e-3, 3e8), (4, 2e-3, 1e8)), tp_factors=((2, True, 3.0),))
    with_ddp = dataclasses.replace(tp_only, tp_ddp_factors=((2, True, 4.0),))
    before, after = (step_time(args, dims, traffic, hw, **kw) for hw in (tp_only, with_ddp))
    assert "dp_replicate" in before.comm_s and "dp_replicate" not in after.comm_s and "tp" not in after.comm_s
    from plait.plan.shapes import stage_params, stages_of

    params = sum(len(stage_params(args, dims, s, 0)) for s in stages_of(dims, 0))
    opt = 2 * _step_ops_s(args, dims, tp_only)  # stretched 2x: 4 ranks on 2 cores
    plain_mb = (before.compute_s - opt) / 3.0  # the plain model's microbatch, as the 4 ranks take it
    ddp_ops = 2 * 2 * params * with_ddp.op_s  # DDP_OPS_PER_PARAM, stretched
    assert after.compute_s == pytest.approx(4.0 * plain_mb + opt - ddp_ops)
    shard = apply_overrides(load("tiny"), ["--parallel.dp_shard", "2", "--parallel.tp", "2"])
    args, dims = check(shard, 4)
    st = step_time(args, dims, bytes_per_step(args, dims, **kw), with_ddp, **kw)
    assert "dp_shard" in st.comm_s and st.compute_s == pytest.approx(
        step_time(args, dims, bytes_per_step(args, dims, **kw), tp_only, **kw).compute_s)


def test_fsdp_x_t_takes_the_factor_measured_under_fully_shard_and_holds_the_dp_axes():
    """S2 T2 on 4 processes with the probe's FSDP x T factor (TP under fully_shard over the other
    2): a microbatch costs that factor, and neither the dp_shard axis nor FSDP's own ops per
    group are charged again; HSDP x T (R2 S2 T2 on 8) takes it too and holds both dp axes; R2 T2
    is not FSDP x T and keeps the TP factor."""
    import dataclasses

    from plait.plan.shapes import fsdp_groups, stage_params, stages_of
    from plait.plan.timing import FSDP_OPS_PER_GROUP

    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    hw = Hardware(cores=2, nproc=4, collectives=((2, 1e-3, 3e8), (4, 2e-3, 1e8)), tp_factors=((2, True, 3.0),))
    with_fsdp = dataclasses.replace(hw, tp_fsdp_factors=((2, True, 4.0),))
    args, dims = check(apply_overrides(load("tiny"), ["--parallel.dp_shard", "2", "--parallel.tp", "2"]), 4)
    traffic = bytes_per_step(args, dims, **kw)
    before, after = (step_time(args, dims, traffic, h, **kw) for h in (hw, with_fsdp))
    assert "dp_shard" in before.comm_s and not {"dp_shard", "tp"} & set(after.comm_s)
    opt = 2 * _step_ops_s(args, dims, hw)  # stretched 2x: 4 ranks on 2 cores
    plain_mb = (before.compute_s - opt) / 3.0
    groups = sum(len(fsdp_groups(stage_params(args, dims, s, 0))) for s in stages_of(dims, 0))
    fsdp_ops = 2 * FSDP_OPS_PER_GROUP * groups * hw.op_s
    assert after.compute_s == pytest.approx(4.0 * plain_mb + opt - fsdp_ops)
    args, dims = check(apply_overrides(load("tiny"), ["--parallel.dp_shard", "1", "--parallel.dp_replicate", "2",
                                                      "--parallel.tp", "2"]), 4)
    traffic = bytes_per_step(args, dims, **kw)
    assert step_time(args, dims, traffic, with_fsdp, **kw) == step_time(args, dims, traffic, hw, **kw)
    args, dims = check(apply_overrides(load("tiny"), ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                                                      "--parallel.tp", "2"]), 8)
    kw8 = dict(kw, batch_size=16)
    traffic = bytes_per_step(args, dims, **kw8)
    hsdp = step_time(args, dims, traffic, dataclasses.replace(with_fsdp, nproc=8, collectives=((8, 3e-3, 1e8),)),
                     **kw8)
    assert {"dp_replicate", "dp_shard"} <= set(traffic) and not {"dp_replicate", "dp_shard", "tp"} & set(hsdp.comm_s)


def test_a_measured_cp_factor_holds_the_cp_axis_and_fsdp_s_own_ops():
    """R2 C2 on 4 processes with the probe's CP factor (ring attention under fully_shard over the
    cp group, as plait train shards CP layouts): a microbatch costs the factor times the plain
    model's, and neither the cp axis (the ring's and FSDP's collectives over it) nor FSDP's own
    ops per group are charged again; the replicas' all-reduce still is."""
    import dataclasses

    from plait.plan.shapes import fsdp_groups, stage_params, stages_of
    from plait.plan.timing import FSDP_OPS_PER_GROUP, host_ops, stage_flops_per_token

    args, dims = check(apply_overrides(load("tiny"), ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                                                      "--parallel.cp", "2"]), 4)
    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    traffic = bytes_per_step(args, dims, **kw)
    hw = Hardware(cores=2, nproc=4, collectives=((2, 1e-3, 3e8), (4, 2e-3, 1e8)), cp_factors=((2, 2.5),))
    st = step_time(args, dims, traffic, hw, **kw)
    assert "cp" in traffic and "cp" not in st.comm_s and "dp_replicate" in st.comm_s
    plain, opts = dataclasses.replace(dims, cp=1), dict(ac_mode="none", ac_every=2)
    tokens = 8 // 2 * 32 // 2  # a rank's: the batch over dp, half of each sequence
    mb = 2.5 * 2 * (tokens * stage_flops_per_token(args, plain, 0, seq_len=32, **opts) / hw.flop_rate
                    + host_ops(args, plain, 0, **opts)[0] * hw.op_s)
    groups = sum(len(fsdp_groups(stage_params(args, dims, s, 0))) for s in stages_of(dims, 0))
    opt = 2 * (_step_ops_s(args, dims, hw) - FSDP_OPS_PER_GROUP * groups * hw.op_s)
    assert st.compute_s == pytest.approx(mb + opt)


def test_fsdp_and_hsdp_take_the_fsdp_factor_at_their_shard_size():
    """S4 and R2 S2 on 4 processes with the probe's FSDP factors: a microbatch costs the factor
    at dp_shard times the plain model's, the dp_shard axis and FSDP's ops per group are not
    charged again, HSDP's replica all-reduce still is; with a pipeline the factor is not used
    (FSDP there gathers once a step, not once a microbatch)."""
    import dataclasses

    from plait.plan.shapes import fsdp_groups, stage_params, stages_of
    from plait.plan.timing import FSDP_OPS_PER_GROUP

    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    hw = Hardware(cores=2, nproc=4, collectives=((2, 1e-3, 3e8), (4, 2e-3, 1e8)))
    with_fsdp = dataclasses.replace(hw, fsdp_factors=((2, 1.5), (4, 2.0)))
    for overrides, factor in ((["--parallel.dp_shard", "4"], 2.0),
                              (["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"], 1.5)):
        args, dims = check(apply_overrides(load("tiny"), overrides), 4)
        traffic = bytes_per_step(args, dims, **kw)
        plain = step_time(args, dims, traffic, hw, **kw)
        st = step_time(args, dims, traffic, with_fsdp, **kw)
        assert "dp_shard" in plain.comm_s and "dp_shard" not in st.comm_s
        assert ("dp_replicate" in st.comm_s) == (dims.dp_replicate > 1)
        groups = sum(len(fsdp_groups(stage_params(args, dims, s, 0))) for s in stages_of(dims, 0))
        opt = 2 * _step_ops_s(args, dims, hw)  # stretched 2x: 4 ranks on 2 cores
        fsdp_ops = 2 * FSDP_OPS_PER_GROUP * groups * hw.op_s
        assert st.compute_s == pytest.approx(factor * (plain.compute_s - opt) + opt - fsdp_ops)
    args, dims = check(apply_overrides(load("tiny"), ["--parallel.dp_shard", "2", "--parallel.pp", "2"]), 4)
    traffic = bytes_per_step(args, dims, **kw)
    assert step_time(args, dims, traffic, with_fsdp, **kw) == step_time(args, dims, traffic, hw, **kw)


def test_oversubscribed_pipeline_ranks_fill_one_another_s_bubbles():
    """R4 P2 GPipe/m2 over 8 ranks: with a core each, compute is the schedule's makespan, bubble
    included; on 2 cores a rank's idle slots go to the others' work, so it is the busy time (the
    makespan less its bubble) stretched 4x, not the stretched makespan."""
    config = apply_overrides(load("small"), ["--parallel.dp_replicate", "4", "--parallel.dp_shard", "1",
                                             "--parallel.pp", "2", "--parallel.pp_schedule", "GPipe",
                                             "--parallel.microbatches", "2"])
    args, dims = check(config, 8)
    kw = dict(seq_len=128, batch_size=16, global_rank=0)
    own, shared = (step_time(args, dims, {}, Hardware(cores=c), **kw) for c in (0, 2))
    assert shared.bubble == own.bubble > 0.2
    opt = _step_ops_s(args, dims, Hardware())
    makespan = own.compute_s - opt
    assert shared.compute_s == pytest.approx(4 * (1 - own.bubble) * makespan + 4 * opt)
    assert shared.compute_s < 4 * own.compute_s
