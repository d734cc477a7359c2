"""The cost model's formulas on hand-computed cases (pure: no process)."""

from __future__ import annotations

import json

import pytest

from plait.plan.hardware import Hardware
from plait.plan.layouts import enumerate_layouts
from plait.plan.memory import memory_per_rank
from plait.plan.shapes import chunk, stage_params
from plait.plan.timing import AC_OPS, step_time
from plait.plan.traffic import all_gather, all_reduce, bytes_per_step
from plait.train.config import apply_overrides, load
from plait.train.layout import check


def _dims(world, overrides):
    config = apply_overrides(load("tiny"), overrides)
    return config, *check(config, world)


def test_chunk_matches_torch_chunk():
    assert [chunk(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert [chunk(5, 4, r) for r in range(4)] == [2, 2, 1, 0]  # torch.chunk leaves the last empty


def test_ring_counts():
    assert all_reduce(4, 8) == 12 and all_reduce(1, 100) == 0
    assert all_gather(2, 100) == 100
    assert all_gather(2, 32 << 20) == all_reduce(2, 64 << 20)  # Gloo's all-reduce form past 32 MiB


def test_tp_sp_by_hand():
    """tiny, tp 2 + SP, batch 8 x 32 tokens, dim 64: X = (2-1) * 8 * 16 * 64 * 4 = 32768 bytes per
    all-gather / reduce-scatter; 2 blocks x 8, embedding 2, output 2: 20 X; loss_parallel 3 x 1024;
    SP norms 5 x 256; the trainer's scalars 8 + 8 + 4."""
    config, args, dims = _dims(2, ["--parallel.dp_shard", "1", "--parallel.tp", "2"])
    got = bytes_per_step(args, dims, seq_len=32, batch_size=8, global_rank=0)
    assert got == {"tp": 20 * 32768 + 3 * 1024 + 5 * 256 + 20}


def test_fsdp_pads_uneven_shards():
    """dp_shard 3 over dim 64 rows: ceil(64/3) = 22 rows per rank, 66 padded; the group's
    all-gather input is the padded sum on every rank."""
    config, args, dims = _dims(3, ["--parallel.dp_shard", "3", "--training.batch_size", "6"])
    block = [p for p in stage_params(args, dims, 0, 0) if p.block == 0]
    padded = sum(p.fsdp_padded(3) for p in block)
    real = sum(p.numel for p in block)
    assert padded * 3 > real and sum(p.fsdp_local(3, r) for p in block for r in range(3)) == real
    got = bytes_per_step(args, dims, seq_len=32, batch_size=6, global_rank=1)
    root = sum(p.fsdp_padded(3) for p in stage_params(args, dims, 0, 0) if p.block is None)
    fsdp = 2 * (3 * 2 * padded * 4) + 2 * root * 4 * 2  # blocks: 2 gathers + 1 RS; root: 1 + 1
    assert got["dp_shard"] == fsdp + 2 * all_reduce(3, 8) + all_reduce(3, 4)


@pytest.mark.parametrize("overrides,world", [
    (["--parallel.dp_shard", "4"], 4), (["--parallel.dp_shard", "2", "--parallel.tp", "2"], 4),
    (["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"], 4)])
def test_sharded_state_sums_to_the_model(overrides, world):
    """FSDP shards sum over the dp ranks to the TP-local parameters; TP pieces sum to the model
    (plus the norms each tp rank holds whole)."""
    config, args, dims = _dims(world, overrides)
    total = sum(memory_per_rank(args, dims, seq_len=32, batch_size=8, global_rank=r).params
                for r in range(world)) // 4
    replicas = dims.dp_replicate
    norms = (2 * args.n_layers + 1) * args.dim * (dims.tp - 1)
    assert total == replicas * (args.num_params() + norms)


def test_checkpointing_trades_activations_for_compute():
    config, args, dims = _dims(2, ["--parallel.dp_shard", "2"])
    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    plain, full = (memory_per_rank(args, dims, ac_mode=m, **kw) for m in ("none", "full"))
    assert full.activations < plain.activations and full.params == plain.params
    hw = Hardware()
    t_plain, t_full = (step_time(args, dims, {}, hw, ac_mode=m, **kw) for m in ("none", "full"))
    flops = lambda t: t.compute_s - t.host_s  # noqa: E731
    assert flops(t_full) == pytest.approx(flops(t_plain) * 8 / 6, rel=0.05)
    assert t_plain.host_s < t_full.host_s < t_plain.host_s * AC_OPS  # blocks' ops rerun, the optimizer's not


def test_pipeline_bubble_from_the_simulator():
    """1F1B, p = 2, m = 2 at unit costs: bubble (p-1)/(m+p-1) = 1/3."""
    config, args, dims = _dims(2, ["--parallel.dp_shard", "1", "--parallel.pp", "2"])
    t = step_time(args, dims, {}, Hardware(), seq_len=32, batch_size=8, global_rank=0)
    assert t.bubble == pytest.approx(1 / 3)


def test_plan_cli_json_records(capsys):
    from plait.plan.cli import main

    assert main(["--config", "tiny", "--nproc", "2", "--json", "--top", "3", "--memory-per-rank", "2GiB"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 3
    for r in records:
        assert {"layout", "memory_bytes_per_rank", "bytes_sent_per_rank", "step_seconds", "command"} <= set(r)
        assert r["fits"] and r["command"].startswith("plait run --standalone --nproc-per-node 2")
    assert records[0]["step_seconds"] <= records[-1]["step_seconds"]


def test_plan_cli_table_and_pipeline_topic(capsys):
    from plait.cli import main

    assert main(["plan", "--config", "tiny", "--nproc", "4", "--top", "2", "--rejected"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "plait run --standalone --nproc-per-node 4" in out and "n_layers(2)" in out
    assert main(["plan", "pipeline", "--schedule", "1F1B", "--ranks", "2", "--microbatches", "4"]) == 0
    assert "bubble" in capsys.readouterr().out
    assert main(["plan", "--config", "tiny"]) == 2  # --nproc missing


def test_enumeration_counts_are_stable():
    kept, rejected = enumerate_layouts(load("tiny"), 1)
    assert [k.choice.ac_mode for k in kept] == ["none", "full", "every"] and not rejected


def test_cp_ring_by_hand():
    """tiny, cp 2, batch 8 x 32 tokens: each rank holds 16 tokens a sequence; K and V repeated to
    8 heads of 8, packed: 2 * 8 * 8 * 16 * 8 * 4 = 65536 bytes. Per layer forward 1 all-gather,
    backward 1 all-gather + 1 reduce-scatter (tests/tensor/test_context_parallel.py's counts):
    3 x 65536 per layer, one all-gather more per checkpointed block."""
    from plait.plan.traffic import ring_bytes

    _, args, dims = _dims(2, ["--parallel.dp_shard", "1", "--parallel.cp", "2"])
    assert ring_bytes(args, dims, (0, 1), seq_len=32, batch_size=8) == 2 * 3 * 65536
    assert ring_bytes(args, dims, (0, 1), seq_len=32, batch_size=8, ac_mode="full") == 2 * 4 * 65536
    got = bytes_per_step(args, dims, seq_len=32, batch_size=8, global_rank=0)
    assert set(got) == {"cp"} and got["cp"] > 2 * 3 * 65536  # FSDP over dp_shard_cp (= cp) rides the same axis
    one = memory_per_rank(args, dims, seq_len=32, batch_size=8, global_rank=0)
    _, args1, dims1 = _dims(1, [])
    full = memory_per_rank(args1, dims1, seq_len=32, batch_size=8, global_rank=0)
    assert one.params * 2 == full.params  # FSDP shards over the cp ranks
    assert one.activations < 0.55 * full.activations  # half the tokens per rank


def test_cp_step_time_puts_the_ring_on_the_critical_path():
    _, args, dims = _dims(2, ["--parallel.dp_shard", "1", "--parallel.cp", "2"])
    traffic = bytes_per_step(args, dims, seq_len=32, batch_size=8, global_rank=0)
    hw = Hardware(overlap=1e9)  # every data-parallel byte hidden: what is left exposed is the ring
    st = step_time(args, dims, traffic, hw, seq_len=32, batch_size=8, global_rank=0)
    assert st.exposed_s == pytest.approx(2 * 3 * 65536 / hw.bandwidth)


def test_walk_holds_the_microbatches_in_flight_and_the_grads_after_the_first_backward():
    """1F1B on 2 ranks, 2 microbatches: rank 0 runs F0 F1 B0 B1 (two microbatches held at its first
    B), rank 1 F0 B0 F1 B1 (one, but the grads of its first B beside the second)."""
    from plait.plan.memory import StageCost, working_peak

    config, args, dims = _dims(2, ["--parallel.dp_shard", "1", "--parallel.pp", "2"])
    cost = StageCost(acts=10, grads=3, kept=0, forward=0, moments=((0, 1),))
    assert working_peak(dims, 0, {0: cost}) == 10 + 10 + 1
    assert working_peak(dims, 1, {1: cost}) == 10 + 3 + 1


def test_one_rank_peaks_at_the_loss_backward():
    """No parallelism: parameters + AdamW + every saved activation + the logits' two gradients
    (T x V float32 each: log_softmax's output grad and the logits' grad)."""
    config, args, dims = _dims(1, [])
    mem = memory_per_rank(args, dims, seq_len=32, batch_size=8, global_rank=0)
    tokens, vocab = 8 * 32, args.vocab_size
    assert mem.total == mem.params + mem.optimizer + mem.activations + 2 * tokens * vocab * 4


@pytest.mark.parametrize("pp,m,exposed", [(2, 2, {"GPipe": 2, "1F1B": 2}), (4, 4, {"GPipe": 6, "1F1B": 10}),
                                           (2, 8, {"GPipe": 2, "1F1B": 8})])
def test_pipeline_transfers_cost_what_the_schedule_leaves_on_its_critical_path(pp, m, exposed):
    """Each stage-to-stage transfer delays its consumer by one call's cost (the pp axis' figure over
    its calls) inside the simulator; the axis is charged the makespan that adds: here, with a call
    short against an action, `exposed` calls. GPipe streams its transfers where 1F1B's steady state
    waits on its neighbour each action, so past 2 stages and 2 microbatches 1F1B exposes more."""
    from plait.plan.traffic import calls_per_step

    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    hw = Hardware(latency=1e-6, bandwidth=1e12, flop_rate=1e6)  # a call far shorter than an action
    for schedule in ("GPipe", "1F1B"):
        _, args, dims = _dims(pp, ["--parallel.dp_shard", "1", "--parallel.pp", str(pp), "--parallel.pp_schedule",
                                   schedule, "--parallel.microbatches", str(m), "--model.n_layers", str(pp)])
        traffic, calls = bytes_per_step(args, dims, **kw), calls_per_step(args, dims, **kw)
        st = step_time(args, dims, traffic, hw, **kw)
        per_call = traffic["pp"] / hw.bandwidth / calls["pp"] + hw.latency
        assert st.comm_s["pp"] == pytest.approx(exposed[schedule] * per_call, rel=1e-6), schedule
        assert exposed[schedule] < calls["pp"]  # not every call in full, as other axes are charged


def test_pipeline_transfers_measured_among_ranks_that_outnumber_the_cores_are_charged_every_call():
    """8 ranks on 2 cores, figures calibrated among 8 processes: a rank's wait runs another's work,
    so no schedule hides a call; each costs the wall it was measured to add, as on other axes: the
    probe's p2p figure for a send or a receive, or without one a 2-rank collective's."""
    import dataclasses

    from plait.plan.traffic import calls_per_step

    kw = dict(seq_len=32, batch_size=8, global_rank=0)
    hw = Hardware(cores=2, nproc=8, collectives=((2, 1e-3, 3e8), (8, 4e-3, 1e8)))
    for schedule in ("GPipe", "1F1B"):
        _, args, dims = _dims(8, ["--parallel.dp_shard", "2", "--parallel.pp", "4", "--parallel.pp_schedule",
                                  schedule, "--parallel.microbatches", "4", "--model.n_layers", "4"])
        traffic, calls = bytes_per_step(args, dims, **kw), calls_per_step(args, dims, **kw)
        st = step_time(args, dims, traffic, hw, **kw)
        assert st.comm_s["pp"] == pytest.approx(traffic["pp"] / 3e8 + calls["pp"] * 1e-3), schedule
        assert st.exposed_s == pytest.approx(sum(st.comm_s.values()))
        probed = step_time(args, dims, traffic, dataclasses.replace(hw, p2p=4e-4), **kw)
        assert probed.comm_s["pp"] == pytest.approx(traffic["pp"] / 3e8 + calls["pp"] * 4e-4), schedule
        assert probed.step_s == pytest.approx(st.step_s - calls["pp"] * 6e-4)
        elsewhere = step_time(args, dims, traffic, dataclasses.replace(hw, p2p=4e-4, nproc=4), **kw)
        assert elsewhere.comm_s["pp"] != probed.comm_s["pp"]  # measured among 4 processes: not this job's
