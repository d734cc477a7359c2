"""Elastic training end to end: `plait run --nnodes 1:2` trains on two nodes, loses one with a
checkpoint in flight, and the surviving node finishes the job alone from the latest complete
checkpoint with half the data-parallel degree.

    node A (store host) ─┐  round: 2 nodes × 2 workers, FSDP over 4 ranks, checkpoint every 3
    node B (victim)     ─┘  steps 1..6 run; B's ranks stop at the save of step 6, A's wait in it
    test: step-000003 complete ─▶ B lost: killed (SIGKILL of its agent's process group; its
          workers die with it) or frozen (SIGSTOP of the agent and its workers: no connection
          closes, as a node that lost power or network)
    A: the round ends (killed: a worker's Gloo error or B's heartbeat; frozen: the heartbeat
       only, A's workers hang in the collective until stopped) ─▶ restart 1 of 1
       ─▶ a round with A alone: world 2, FSDP over 2 ranks ─▶ resumes step 3 ─▶ steps 4..10

The trainer is `python -m plait.train` behind two test seams (workers/elastic_train.py): it
records the sample indices each rank draws, and it stops B's ranks at a known step. With
`--nnodes 1:2`, A may start a round alone before B joins; the seam holds such a round before
training, so B's arrival regroups it (no restart spent) and the run is the same every time.

Checked from what the job leaves behind: the JSONL log has steps 1..6 on 4 ranks, then 4..10
on 2 ranks (resumed from step 3, the latest complete checkpoint, not the step-6 save in
flight: nothing lost beyond the checkpoint, nothing skipped); every logged loss equals the
uninterrupted 1-process run of the same config (tests/train/test_parity's reference) within
rtol/atol 1e-5 — the parity tolerance, since FSDP over 4 or 2 ranks only reorders float32
sums (measured ≤ 1.4e-6 there) and the resumed state is exact; the kept steps' batches
(1..3 dealt 4 ways, 4..10 dealt 2 ways) are exactly the 1-process stream's, so no sample is
repeated or skipped across the change of dp degree; no process and no port is left behind.

Bounds: every wait is for an event (conftest.HANG_S). Losing B is noticed by a Gloo error at
once or by the heartbeat in keep_alive_interval × keep_alive_max_attempt = 8 s (FAST).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from plait.data.text import TokenWindows, build_corpus
from plait.train import load
from plait.train.data import BatchStream
from tests.run.conftest import HANG_S, free_port, port_is_free
from tests.run.test_multinode import c10d
from tests.train.test_parity import TOL, reference

STEPS, INTERVAL, PAUSE = 10, 3, 6  # the tiny config's 10 steps; B stops at the save of step 6
KEPT = INTERVAL  # the latest complete checkpoint when B is lost


def one_process_stream(steps: int) -> list[list[int]]:
    """The sample indices of each step in a 1-process run of the tiny config."""
    cfg = load("tiny")
    tokens, _ = build_corpus(max_bytes=cfg.data.max_bytes)
    train_set = TokenWindows(tokens, seq_len=cfg.training.seq_len, split="train",
                             val_fraction=cfg.data.val_fraction)
    stream = BatchStream(train_set, global_batch=cfg.training.batch_size, dp_rank=0, dp_size=1,
                         seed=cfg.job.seed)
    return [stream.next_indices().tolist() for _ in range(steps)]


def drawn(job, world: int) -> dict[int, list[int]]:
    """step -> the union of the indices the ranks of `world` drew for it (sorted)."""
    per_step: dict[int, list[int]] = {}
    for rank in range(world):
        path = job.out / f"indices_w{world}_r{rank}.jsonl"
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            assert rec["epoch"] == 0
            per_step.setdefault(rec["consumed"] // 8 + 1, []).extend(rec["indices"])
    return {s: sorted(ix) for s, ix in per_step.items()}


def segments(jsonl) -> list[dict]:
    """The log cut at each `config` record: one segment per trainer start."""
    out: list[dict] = []
    for line in jsonl.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "config":
            out.append({"world": rec["world_size"], "start": rec["start_step"], "layout": rec["layout"],
                        "steps": []})
        elif rec["kind"] == "step":
            out[-1]["steps"].append(rec)
    return out


def wait_for_path(path, what: str, agents) -> None:
    deadline = time.monotonic() + HANG_S
    while not path.exists():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- agent {i}\n{a.output().err[-3000:]}\n{a.stacks_now()}" for i, a in enumerate(agents))
            raise AssertionError(f"{what}: {path} did not appear within {HANG_S} s\n{logs}")
        time.sleep(0.05)


def lose_node(job, victim, how: str) -> None:
    """"killed": SIGKILL of B's agent's process group (its workers die with it, closing their
    connections: A's workers fail at once). "frozen": B's agent and workers stopped (SIGSTOP), as
    a node that lost power or network: no connection closes, A's workers hang in the collective,
    and only B's silent heartbeat tells A's agent."""
    if how == "killed":
        os.killpg(victim.pid, signal.SIGKILL)
        return
    workers = [job.read(name)["pid"] for name in job.outputs("paused_r")]
    os.killpg(victim.pid, signal.SIGSTOP)
    for pid in workers:
        os.killpg(pid, signal.SIGSTOP)  # each worker leads its own process group


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_losing_a_node_resumes_on_the_survivor_with_half_the_dp_degree(job, how):
    port = free_port()
    run = job.dir / "run"
    args = [*c10d(port, "1:2", "--max-restarts", "1"), "--nproc-per-node", "2",
            "-m", "tests.run.workers.elastic_train", "--config", "tiny", "--parallel.dp_shard", "-1",
            "--checkpoint.enabled", "true", "--checkpoint.interval", str(INTERVAL),
            "--metrics.progress", "false", "--job.dir", str(run)]
    env = {"ELASTIC_PAUSE_STEP": str(PAUSE), "ELASTIC_SMALL_WORLD": "2"}
    host = job.start(*args, env=env)
    host.wait_for_stderr("serving the rendezvous store")
    victim = job.start(*args, env={**env, "ELASTIC_VICTIM": "1"})

    job.wait_for_outputs("paused_r", 2)  # B's two ranks reached the save of step 6
    folder = run / "checkpoints"
    wait_for_path(folder / f"step-{KEPT:06d}" / "metadata.json", "the step-3 checkpoint", [host, victim])
    assert not (folder / f"step-{PAUSE:06d}").exists()  # in flight: B's ranks never wrote theirs
    lose_node(job, victim, how)
    (job.out / "NODE_LOST").touch()

    r = host.wait()
    assert r.rc == 0, r.err[-6000:]
    if how == "frozen":
        assert "lost: no heartbeat for" in r.err, r.err[-6000:]
        os.killpg(victim.pid, signal.SIGKILL)  # its stopped workers die with it (PDEATHSIG)
    assert victim.wait().rc == -signal.SIGKILL
    assert "restarting every worker (restart 1 of 1)" in r.err, r.err[-6000:]
    assert "1 node(s), world size 2" in r.err.rsplit("restarting every worker", 1)[1]

    # the log: 4 ranks ran 1..6, then 2 ranks resumed the step-3 checkpoint and ran 4..10
    segs = segments(run / "metrics.jsonl")
    assert [(s["world"], [x["step"] for x in s["steps"]]) for s in segs] == [
        (4, list(range(1, PAUSE + 1))), (2, list(range(KEPT + 1, STEPS + 1)))]
    assert [s["start"] for s in segs] == [0, KEPT]
    assert [s["layout"] for s in segs] == [f"dp_replicate(1) x dp_shard({n}) x tp(1) x pp(1) = {n} ranks"
                                           for n in (4, 2)]

    # every logged loss equals the uninterrupted 1-process run's (both segments; 4..6 twice)
    ref = reference()
    for s in segs:
        steps = [x["step"] for x in s["steps"]]
        got = torch.tensor([x["loss"] for x in s["steps"]])
        want = torch.tensor([ref["losses"][k - 1] for k in steps])
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, w=s["world"]: f"world {w} losses: {m}")
    final = {x["step"]: x["val_loss"] for x in segs[1]["steps"] if x["val_loss"] is not None}
    assert sorted(final) == [5, 10]
    torch.testing.assert_close(final[10], ref["val"][10], **TOL)

    # the global stream: steps 1..3 dealt 4 ways, then 4..10 dealt 2 ways, are the 1-process
    # stream's batches — so no sample repeated or skipped across the dp change
    expected = one_process_stream(STEPS)
    big, small = drawn(job, 4), drawn(job, 2)
    assert sorted(small) == list(range(KEPT + 1, STEPS + 1))
    kept = [big[s] for s in range(1, KEPT + 1)] + [small[s] for s in range(KEPT + 1, STEPS + 1)]
    assert kept == [sorted(b) for b in expected]
    flat = [i for b in kept for i in b]
    assert len(flat) == len(set(flat)) == STEPS * 8

    # checkpoints: the one in flight was redone by the survivor; nothing partial is left
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{k:06d}" for k in (3, 6, 9, 10)]
    job.assert_no_process_left()
    assert port_is_free(port)
