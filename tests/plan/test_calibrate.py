"""The calibration probe and its cache, and the step time's use of per-call costs measured at the
job's process count (pure logic, but for one small forked probe)."""

from __future__ import annotations

import json
import math

import pytest

from plait.plan import calibrate as cal
from plait.plan.timing import Hardware, step_time
from plait.plan.traffic import bytes_per_step, calls_per_step
from plait.train.config import apply_overrides, load
from plait.train.layout import check


def test_group_sizes_are_the_divisors_a_layout_can_use():
    assert cal.group_sizes(8) == [2, 4, 8]
    assert cal.group_sizes(6) == [2, 3, 6]
    assert cal.group_sizes(1) == []


def test_probe_reports_a_cost_per_call_and_a_bandwidth_per_group_size():
    """4 forked processes, two rounds of two calls per variant: the shape of what it reports, and
    figures a machine can give (a call costs something and under a second; bytes move)."""
    table, dtensor_op_s = cal.collective_costs(4, budget_s=60.0, repeats=2)
    assert sorted(table) == [2, 4]
    for call, bandwidth in table.values():
        assert 0.0 <= call < 1.0 and bandwidth > 0
    assert 0.0 < dtensor_op_s < 0.1


@pytest.fixture
def fake_probe(monkeypatch, tmp_path):
    """The probe's measurements replaced by fixed figures: what calibrate caches and reads back."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    runs = []

    def costs(nproc, **kw):
        runs.append(nproc)
        return {g: (1e-3 * g, 1e8 / g) for g in cal.group_sizes(nproc)}, 2e-5

    monkeypatch.setattr(cal, "collective_costs", costs)
    monkeypatch.setattr(cal, "block_costs", lambda args, **kw: (5e-6, 4e10, 1.5))
    return runs


def test_calibration_is_cached_per_process_count(fake_probe, tmp_path):
    args, _ = check(load("tiny"), 1)
    hw8 = cal.calibrate(args, batch=2, seq_len=32, nproc=8)
    assert hw8.nproc == 8 and hw8.collectives == ((2, 2e-3, 5e7), (4, 4e-3, 2.5e7), (8, 8e-3, 1.25e7))
    assert (hw8.op_s, hw8.flop_rate, hw8.dtensor_op_s, hw8.ac_factor) == (5e-6, 4e10, 2e-5, 1.5)
    assert (hw8.latency, hw8.bandwidth) == (2e-3, 5e7)  # the smallest group's
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
