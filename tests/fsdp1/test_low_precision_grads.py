"""MixedPrecision(keep_low_precision_grads=True), torch FSDP1's meaning: after backward each
sharded parameter (float32) holds a .grad in param_dtype (bfloat16), its float32 reduced
sum cast down once; a .grad kept over a second backward is added to in float32 and cast
down once; the optimizer steps on the bfloat16 grad (SGD accepts it; torch's AdamW refuses
it under either library); clip_grad_norm_ sums in float32 and returns the norm in bfloat16.

Reference: tests/fsdp/test_policies.py's bf16 step (a bf16 copy, per-slice backward, the
slices' grads summed in float32 and divided by N), whose float32 grads are then cast to
bfloat16 with torch's own `.grad.data =` (what torch's FSDP1 does to its flat grad).

Tolerances. Grads: 1 bf16 ulp (rtol 2**-7): both round float32 sums of the same terms,
added in another order (reduce-scatter vs rank order), so a value next to a rounding
boundary may land one ulp apart; a missing 1/N, a doubled shard or a second rounding of
the accumulated grad is off by far more than one ulp on many elements. Parameters after
10 SGD steps (lr 0.1): each step moves a parameter by lr * grad, so one-ulp grad
differences add up to at most ~10 * 0.1 * 2**-7 * |grad| (atol 1e-4, rtol 1e-4; SGD on the
float32 parameters itself rounds nothing). Against torch's FSDP1: the same rounding
argument, losses rtol 1e-5 (the forward sees the same bf16 casts of parameters that agree
to float32 rounding), the returned bf16 norm within one ulp.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from plait.fsdp import FullyShardedDataParallel as FSDP
from plait.fsdp import MixedPrecision
from plait.testing import distributed
from tests.fsdp.common import (
    PER_RANK,
    Block,
    assert_full_params_close,
    batch,
    build,
    global_mean,
    mine,
    world,
)
from tests.fsdp.test_policies import _reference_bf16_step
from tests.fsdp1.common import wrap

BF16 = torch.bfloat16
ULP = 2.0 ** -7  # bfloat16's relative spacing (8 significant bits)
STEPS = 10
MP = dict(param_dtype=BF16, reduce_dtype=torch.float32, keep_low_precision_grads=True, cast_forward_inputs=True)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_grads(model, ref_grads: dict[str, torch.Tensor], what: str) -> None:
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == BF16, (name, p.dtype, p.grad.dtype)
        torch.testing.assert_close(_whole(p.grad).float(), ref_grads[name].float(), rtol=ULP, atol=1e-7,
                                   msg=lambda m, name=name: f"{what}: grad {name}: {m}")


def _ref_low_grads(ref) -> dict[str, torch.Tensor]:
    """Cast the reference's float32 grads to bf16 as torch's FSDP1 does (`.grad.data =`)."""
    for p in ref.parameters():
        p.grad.data = p.grad.to(BF16)
    return {name: p.grad for name, p in ref.named_parameters()}


@distributed([2, 3])
def test_low_precision_grads_parity():
    g, rank, n = world()
    model, ref = wrap(build("mlp"), mixed_precision=MixedPrecision(**MP)), build("mlp")
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    for step in range(STEPS):
        x, y = batch("mlp", step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank))
        loss.backward()
        ref_loss = _reference_bf16_step(ref, x, y, n)
        torch.testing.assert_close(global_mean(loss, g), ref_loss, rtol=1e-5, atol=1e-6)
        _assert_grads(model, _ref_low_grads(ref), f"step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert opt.state[next(model.parameters())]["momentum_buffer"].dtype == BF16  # SGD keeps the grad's
    assert_full_params_close(model, ref, atol=1e-4, rtol=1e-4, what=f"after {STEPS} SGD steps on bf16 grads")


@distributed([2, 3])
def test_low_precision_grads_accumulate_and_clip():
    """Two backwards without zero_grad: bf16(float32(g1 in bf16) + g2), rounded once more
    (torch upcasts the kept grad, accumulates, casts down); clip_grad_norm_ is the global
    norm of those bf16 grads summed in float32, returned in bf16, and scales them."""
    g, rank, n = world()
    model, ref = wrap(build("mlp"), mixed_precision=MixedPrecision(**MP)), build("mlp")
    for step in range(2):
        x, y = batch("mlp", step, n * PER_RANK)
        F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        kept = {name: p.grad.to(BF16) for name, p in ref.named_parameters()} if step else {}
        _reference_bf16_step(ref, x, y, n)
        for name, p in ref.named_parameters():
            if kept:
                p.grad = kept[name].float() + p.grad
    expected = _ref_low_grads(ref)
    _assert_grads(model, expected, "after two backwards")
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v, dtype=torch.float32)
                                                     for v in expected.values()])).to(BF16)
    norm = model.clip_grad_norm_(ref_norm.item() / 2)
    assert norm.dtype == BF16
    torch.testing.assert_close(norm, ref_norm, rtol=ULP, atol=0)
    scaled = model.clip_grad_norm_(float("inf"))  # the norm after clipping: half (the coefficient in bf16)
    torch.testing.assert_close(scaled.float(), ref_norm.float() / 2, rtol=2 * ULP, atol=0)
    with FSDP.summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == BF16 and p.grad.shape == p.shape, name


def _torch_run(lib, n: int, rank: int, *, uop: bool):
    """The same script on either library (only `lib` differs): 5 SGD steps; per step the
    loss, the grads' dtypes and the returned norm; at the end the full state dict."""
    import torch.distributed.fsdp.wrap as torch_wrap

    import plait.fsdp.wrap as plait_wrap

    wrap_mod = torch_wrap if lib.__name__.startswith("torch") else plait_wrap
    policy = functools.partial(wrap_mod.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = lib.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                         mixed_precision=lib.MixedPrecision(**MP), use_orig_params=uop)
    opt = _sgd(model.parameters())
    trace = []
    for step in range(5):
        x, y = batch("mlp", step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank))
        loss.backward()
        dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        trace.append((loss.detach(), dtypes, norm))
    config = lib.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
    with pytest.raises(RuntimeError, match="expected dtype float"):  # a float32 state, a bf16 grad
        adamw.step()
    return trace, state


@distributed([2])
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "orig_params"])
def test_low_precision_grads_match_torch(uop):
    import torch.distributed.fsdp as torch_fsdp

    import plait.fsdp as plait_fsdp

    _, rank, n = world()
    ours, our_state = _torch_run(plait_fsdp, n, rank, uop=uop)
    theirs, their_state = _torch_run(torch_fsdp, n, rank, uop=uop)
    for step, ((loss, dtypes, norm), (t_loss, t_dtypes, t_norm)) in enumerate(zip(ours, theirs)):
        assert dtypes == t_dtypes == {BF16}, (step, dtypes, t_dtypes)
        assert norm.dtype == t_norm.dtype == BF16, (step, norm.dtype, t_norm.dtype)
        torch.testing.assert_close(loss, t_loss, rtol=1e-5, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")
        torch.testing.assert_close(norm, t_norm, rtol=ULP, atol=0, msg=lambda m, s=step: f"step {s}: {m}")
    assert list(our_state) == list(their_state)
    for k, v in their_state.items():
        torch.testing.assert_close(our_state[k], v, rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
