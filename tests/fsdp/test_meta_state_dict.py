"""State dicts into a model built on the meta device — how large models are resumed (torch's
FSDP2 example, `--dcp-api`, second launch): build under torch.device("meta"), fully_shard,
then set_model_state_dict / set_optimizer_state_dict with a full state dict broadcast from
rank 0, and train on. As in torch, a meta model is loaded by assignment: every parameter
becomes a real tensor holding only this rank's shard, and the run continues exactly like an
uninterrupted one (tolerances as tests/fsdp/test_parity.py: loss rtol 1e-5, parameters atol
2e-5 / rtol 1e-4, from the reduce-scatter's order of summation).
"""

import torch
import torch.nn.functional as F

from plait.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from plait.tensor import DTensor
from plait.testing import chunk_sizes, distributed
from tests.fsdp.common import (
    MLP,
    PER_RANK,
    assert_full_params_close,
    batch,
    build,
    global_mean,
    make_opt,
    mine,
    shard,
    train_parity,
    world,
)

FULL_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _meta_model() -> MLP:
    with torch.device("meta"):
        model = MLP()
    shard(model)
    assert all(p.is_meta for p in model.parameters())
    return model


def _assert_real_shards(model: MLP, n: int, rank: int) -> None:
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta, name
        local = p._local_tensor
        assert local.size(0) == chunk_sizes(p.size(0), n)[rank], name
        # the shard only: not a view that keeps rank 0's broadcast full tensor alive
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), name
    assert not any(b.is_meta for b in model.buffers())


def _step(model, opt, step: int, n: int, rank: int, distributed_: bool) -> torch.Tensor:
    x, y = batch("mlp", step, n * PER_RANK)
    if distributed_:
        x, y = mine(x, rank), mine(y, rank)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@distributed([2, 3])
def test_full_state_dict_broadcast_from_rank0_into_a_meta_model_trains_on():
    _, rank, n = world()
    ref = build("mlp", seed=0)
    model = _meta_model()
    set_model_state_dict(model, ref.state_dict() if rank == 0 else {}, options=FULL_FROM_RANK0)
    _assert_real_shards(model, n, rank)
    assert_full_params_close(model, ref, atol=0, rtol=0, what="loaded")
    torch.testing.assert_close(model.scale, ref.scale, atol=0, rtol=0)
    train_parity("mlp", model, ref, steps=3)


@distributed([2])
def test_resume_from_rank_0s_full_model_and_optimizer_equals_an_uninterrupted_run():
    """The FSDP2 example's resume: model and optimizer state saved full (on rank 0), loaded into
    a fresh meta-built model and a new optimizer, then trained: losses every step as a run that
    never stopped."""
    g, rank, n = world()
    ref = build("mlp", seed=0)  # the uninterrupted run, one process
    ref_opt = make_opt(ref.parameters())
    for step in range(2):
        _step(ref, ref_opt, step, n, rank, distributed_=False)
    full_model = get_model_state_dict(ref, options=StateDictOptions(full_state_dict=True))
    full_optim = get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True))

    model = _meta_model()  # the second launch
    set_model_state_dict(model, full_model if rank == 0 else {}, options=FULL_FROM_RANK0)
    opt = make_opt(model.parameters())
    set_optimizer_state_dict(model, opt, full_optim if rank == 0 else {}, options=FULL_FROM_RANK0)
    _assert_real_shards(model, n, rank)
    for step in range(2, 5):
        loss = _step(model, opt, step, n, rank, distributed_=True)
        ref_loss = _step(ref, ref_opt, step, n, rank, distributed_=False)
        torch.testing.assert_close(global_mean(loss, g), ref_loss.item(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"loss at step {step}: {m}")
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="after resume")


@distributed([2])
def test_sharded_state_dict_into_a_meta_model_assigns_dtensors():
    """The sharded path: DTensors from a sharded model of the same layout, assigned."""
    _, rank, n = world()
    source = build("mlp", seed=3)
    ref = build("mlp", seed=3)
    shard(source)
    model = _meta_model()
    set_model_state_dict(model, get_model_state_dict(source))
    _assert_real_shards(model, n, rank)
    assert_full_params_close(model, ref, atol=0, rtol=0, what="sharded load")
    train_parity("mlp", model, ref, steps=2)
