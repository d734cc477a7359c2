"""Comm hooks: the default average, 16-bit compression, PowerSGD, and the bucket API.

Tolerances. allreduce_hook divides by N where the built-in path multiplies by 1/N:
atol 1e-7 / rtol 1e-6 (at most an ulp apart). A 16-bit hook rounds each rank's g_r / N
and every partial sum to the format's unit roundoff u (2^-11 fp16, 2^-8 bf16), so the
average is off by at most ~(N + 1) * u * max_r |g_r| elementwise (relative to the
largest per-rank gradient, not to the mean, which cancellation can make small); checked
on the first step's gradients, before trajectories part. PowerSGD at full rank reconstructs every matrix exactly in exact arithmetic (P is
an orthonormal basis of M_sum Q's columns): through QR, matmuls and error feedback that
is float32 rounding, atol 1e-5 / rtol 1e-4 over 4 steps.
"""

import math

import torch

from plait import comm
from plait.ddp import DistributedDataParallel
from plait.ddp.comm_hooks import default_hooks as default
from plait.ddp.comm_hooks import powerSGD_hook as powerSGD
from plait.debug import CommDebugMode
from plait.testing import distributed
from tests.ddp.common import PER_RANK, batch, build, loss_fn, world


def train(steps, hook=None, state=None, **ddp_kwargs):
    """Per step: (this rank's reduced grads, all-reduce bytes this rank sent)."""
    g, rank, n = world()
    ddp = DistributedDataParallel(build("mlp", seed=0), **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x, y = batch("mlp", step, n * PER_RANK)
        with CommDebugMode() as mode:
            loss_fn("mlp", ddp(x[rank * PER_RANK:(rank + 1) * PER_RANK]), y[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
        out.append(([p.grad.clone() for p in ddp.parameters()], mode.get_comm_bytes()["all_reduce"]))
        opt.step()
        opt.zero_grad()
    return out


def assert_grads_close(got, want, **tol):
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, k=k: f"parameter #{k}: {m}")


def largest_rank_gradients():
    """Per parameter, max over ranks of max |g_r| of the first step's local gradient."""
    g, rank, n = world()
    model = build("mlp", seed=0)
    x, y = batch("mlp", 0, n * PER_RANK)
    loss_fn("mlp", model(x[rank * PER_RANK:(rank + 1) * PER_RANK]), y[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
    scales = torch.stack([p.grad.abs().max() for p in model.parameters()])
    comm.all_reduce(scales, group=g, op="max")
    return scales.tolist()


@distributed([1, 2, 3])
def test_allreduce_and_16_bit_hooks():
    base = train(3)
    for (grads, _), (want, _) in zip(train(3, default.allreduce_hook), base):
        assert_grads_close(grads, want, atol=1e-7, rtol=1e-6)
    fp16 = train(1, default.fp16_compress_hook)
    bf16 = train(1, default.bf16_compress_hook)
    n, scales = world()[2], largest_rank_gradients()
    for grads, u in ((fp16[0][0], 2.0**-11), (bf16[0][0], 2.0**-8)):
        for k, (a, b, scale) in enumerate(zip(grads, base[0][0], scales)):
            err = (a - b).abs().max().item()
            assert err <= (n + 1) * u * scale, (k, err, scale, u)
    for grads in (fp16[0][0], bf16[0][0]):  # compressed, not exact
        assert any(not torch.equal(a, b) for a, b in zip(grads, base[0][0]))
    if world()[2] > 1:  # half the bytes on the wire
        assert 2 * fp16[0][1] == base[0][1] == 2 * bf16[0][1], (fp16[0][1], bf16[0][1], base[0][1])
    wrapped16 = train(1, default.fp16_compress_wrapper(default.allreduce_hook))
    wrapped_bf16 = train(1, default.bf16_compress_wrapper(default.allreduce_hook))
    assert all(torch.equal(a, b) for a, b in zip(wrapped16[0][0], fp16[0][0]))
    assert all(torch.equal(a, b) for a, b in zip(wrapped_bf16[0][0], bf16[0][0]))


@distributed([1, 2, 3])
def test_powerSGD_at_full_rank_equals_plain_all_reduce():
    base = train(4)
    for hook, rank_ in ((powerSGD.powerSGD_hook, 12), (powerSGD.batched_powerSGD_hook, 17)):
        state = powerSGD.PowerSGDState(None, matrix_approximation_rank=rank_, start_powerSGD_iter=2,
                                       min_compression_rate=0)  # compress every tensor
        got = train(4, hook, state, bucket_cap_mb=0.0005)
        for (grads, _), (want, _) in zip(got, base):
            assert_grads_close(grads, want, atol=1e-5, rtol=1e-4)
        assert state.iter == 4 and state.total_numel_after_compression > 0


@distributed([1, 2, 3])
def test_powerSGD_rank_1_bytes_error_feedback_and_warm_start():
    g, rank, n = world()
    state = powerSGD.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    got = train(4, powerSGD.powerSGD_hook, state)  # one bucket: the model is tiny
    plain = train(2, default.allreduce_hook)
    for (grads, _), (want, _) in zip(got[:2], plain):  # before start_powerSGD_iter: plain
        assert all(torch.equal(a, b) for a, b in zip(grads, want))
    # every weight matrix (n, m) goes as P (n, 1) and Q (m, 1); the biases uncompressed
    model = build("mlp", seed=0)
    first = sum(p.numel() for p in model.parameters() if p.dim() == 1) + sum(p.shape[0] for p in model.parameters() if p.dim() == 2)
    second = sum(p.shape[1] for p in model.parameters() if p.dim() == 2)
    ring = 2 * (n - 1) / n
    expected = int(ring * 4 * first) + int(ring * 4 * second)
    assert got[3][1] == expected, (got[3][1], expected)
    assert got[3][1] < plain[1][1] / 2 or n == 1
    assert set(state.error_dict) == {0} and state.error_dict[0].abs().sum() > 0  # error feedback kept
    q_before = state.q_memory_dict[0].clone()
    train(1, powerSGD.powerSGD_hook, state)  # warm start: Q continues from last iteration's
    assert state.q_memory_dict[0].shape == q_before.shape
    assert not torch.equal(state.q_memory_dict[0], q_before)
    rate, before, after = state.compression_stats()
    assert rate > 1 and before > after


def recording_hook(log, bucket):
    log.append(dict(index=bucket.index(), last=bucket.is_last(), raw=bucket.buffer().clone(),
                    params=bucket.parameters(), views_ok=all(
                        gr.untyped_storage().data_ptr() == bucket.buffer().untyped_storage().data_ptr()
                        for gr in bucket.gradients())))
    fut = default.allreduce_hook(None, bucket)
    return fut.then(lambda f: [f.value()])  # a one-element list, as c10d futures hold


@distributed([2, 3])
def test_grad_bucket_api():
    g, rank, n = world()
    model = build("mlp", seed=0)
    local = build("mlp", seed=0)  # this rank's own gradients, for the undivided buffers
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0005)
    log = []
    ddp.register_comm_hook(log, recording_hook)
    x, y = batch("mlp", 0, n * PER_RANK)
    xs, ys = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
    loss_fn("mlp", ddp(xs), ys).backward()
    loss_fn("mlp", local(xs), ys).backward()
    buckets = ddp.reducer.buckets
    assert [e["index"] for e in log] == list(range(len(buckets))) and len(buckets) >= 2
    assert [e["last"] for e in log] == [False] * (len(buckets) - 1) + [True]
    mine = dict(zip(model.parameters(), local.parameters()))
    for entry, bucket in zip(log, buckets):
        assert entry["views_ok"] and entry["params"] == bucket.params
        raw = torch.cat([mine[p].grad.reshape(-1) for p in entry["params"]])
        torch.testing.assert_close(entry["raw"], raw, atol=0, rtol=0)  # not divided by N
    assert math.isclose(sum(e["raw"].numel() for e in log), sum(p.numel() for p in model.parameters()))
