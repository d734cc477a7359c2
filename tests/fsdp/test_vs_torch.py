"""The same script on torch's fully_shard and on plait's, with only the imports changed
(as torch's FSDP2 example is meant to port): a meta-device model, fully_shard per block
and root with a bf16 MixedPrecisionPolicy, explicit prefetch lists, a full state dict
distributed and loaded with assign=True, unshard()/reshard(), 10 AdamW steps, the state
dict gathered with full_tensor(). Losses and parameters agree. (The example's state-dict
load, not reset_parameters on the meta model: with reset_parameters the two disagreed
from the first loss on, torch's CPU DTensor init not being the single-process init, while
plait's is, see test_meta_init.py.)

Tolerance: loss rtol 1e-5, parameters atol 1e-5. Both gather the same bfloat16 casts and
reduce in float32; Gloo's reduce-scatter (torch) and plait's padded reduce-scatter sum the
same two float32 values per element, so what differs is at float32 rounding; a different
gradient (a padding row leaking in, a missing 1/N) would be off by far more.
"""

import torch
import torch.nn.functional as F

from plait.testing import distributed
from tests.fsdp.common import MLP, PER_RANK, batch, global_mean, make_opt, mine, world


def _train(api: str, n: int, rank: int):
    if api == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import distribute_tensor
    else:
        from plait.device_mesh import init_device_mesh
        from plait.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from plait.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", (n,))
    with torch.device("meta"):
        model = MLP()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    assert isinstance(model, FSDPModule) and isinstance(model, MLP)
    blocks = list(model.blocks)
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])
    blocks[1].set_modules_to_backward_prefetch([blocks[0]])
    torch.manual_seed(0)
    full_sd = MLP().state_dict()  # as torch's example: a full state dict, distributed like the meta params
    meta_sd = model.state_dict()
    sharded_sd = {name: torch.nn.Parameter(distribute_tensor(full, meta_sd[name].device_mesh, meta_sd[name].placements))
                  if hasattr(meta_sd[name], "placements") else full for name, full in full_sd.items()}
    model.load_state_dict(sharded_sd, strict=False, assign=True)
    model.unshard()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters(recurse=False))
    model.reshard()
    opt = make_opt(model.parameters())
    losses = []
    for step in range(10):
        x, y = batch("mlp", step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss, _group()))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return losses, full


def _group():
    from plait import comm

    return comm.world_group()


@distributed([2, 3])
def test_torch_fsdp2_script_ported_by_imports():
    _, rank, n = world()
    theirs, their_sd = _train("torch", n, rank)
    ours, our_sd = _train("plait", n, rank)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert list(our_sd) == list(their_sd)
    for name in our_sd:
        torch.testing.assert_close(our_sd[name], their_sd[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
