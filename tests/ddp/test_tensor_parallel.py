"""Data parallel over tensor parallel: on a (dp=2, tp=2) mesh, DistributedDataParallel and
replicate over mesh["dp"] of a model whose parameters are DTensors on mesh["tp"] train
exactly like one process on the whole batch.

The model is built by hand with distribute_tensor (no parallel styles): fc1 column-wise
(weight and bias Shard(0), 9 hidden units: uneven over tp), fc2 row-wise (weight Shard(1),
bias Replicate), a Replicate `scale` applied to tp-batch-sharded activations (as a norm
under sequence parallel: its gradient comes back Partial over tp), a Replicate DTensor
buffer, and a parameter the forward never uses. Each dp rank feeds its slice of the
global batch; inside a dp rank, tp ranks shard it again along the batch for `scale`.

Tolerances (float32): loss rtol 1e-5, parameters atol 2e-5 / rtol 1e-4, as in
tests/ddp/test_parity.py: the sharded matmuls and the dp all-reduce add the same terms in
another order than the single-process backward (~1e-7 relative per step), and five AdamW
steps stay well inside, while a gradient missing a dp or tp contribution is off by 1/2.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.ddp import DistributedDataParallel, replicate
from plait.device_mesh import init_device_mesh
from plait.tensor import DTensor, Replicate, Shard, distribute_tensor
from plait.testing import assert_synced, distributed

PER_DP = 4  # samples per dp rank and step (2 per tp rank for the batch-sharded part)
STEPS = 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.register_buffer("shift", torch.randn(6))
        self.fc1 = nn.Linear(6, 9)
        self.fc2 = nn.Linear(9, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.scale, DTensor):  # the single-process reference
            return self.fc2(torch.tanh(self.fc1(x * self.scale + self.shift)))
        tp = self.scale.device_mesh
        xs = DTensor.from_local(x.chunk(tp.size())[tp.get_local_rank()], tp, [Shard(0)])  # (b/tp, 6)
        h = (xs * self.scale + self.shift).redistribute(tp, [Replicate()])  # all-gather: (b, 6)
        h = torch.tanh(self.fc1(h))  # (b, 6) @ (6, 9/tp) -> Shard(1)
        out = self.fc2(h)  # (b, 9/tp) @ (9/tp, 3) -> Partial, + Replicate bias
        return out.redistribute(tp, [Replicate()]).to_local()


LAYOUT = {"scale": Replicate(), "shift": Replicate(), "fc1.weight": Shard(0), "fc1.bias": Shard(0),
          "fc2.weight": Shard(1), "fc2.bias": Replicate(), "unused.weight": Shard(0), "unused.bias": Replicate()}


def _build(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def _tensor_parallel(model: MLP, tp) -> MLP:
    for fqn, placement in LAYOUT.items():
        owner_name, _, attr = fqn.rpartition(".")
        owner = model.get_submodule(owner_name)
        value = getattr(owner, attr).detach()
        dt = distribute_tensor(value, tp, [placement])
        if fqn == "shift":
            owner.register_buffer(attr, dt)
        else:
            setattr(owner, attr, nn.Parameter(dt))
    return model


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=gen), torch.randint(3, (n,), generator=gen)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


CASES = {  # front door, gradient_as_bucket_view, bucket_cap_mb
    "ddp": ("ddp", False, 0.0001),
    "ddp-view": ("ddp", True, 25),
    "replicate": ("replicate", False, 0.0001),
    "replicate-view": ("replicate", True, 0.0001),
}


@distributed([4])
@pytest.mark.parametrize("case", list(CASES))
def test_dp_over_tp_matches_one_process(case):
    front, view, cap = CASES[case]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, n_dp = mesh.get_local_rank("dp"), mesh.size("dp")
    dp_group = mesh["dp"].get_group()
    # dp rank 1 starts from other weights and buffers: the start-up broadcast must fix them
    model = _tensor_parallel(_build(seed=dp_rank), mesh["tp"])
    ref = _build(seed=0)
    kwargs = dict(device_mesh=mesh["dp"], find_unused_parameters=True, gradient_as_bucket_view=view,
                  bucket_cap_mb=cap)
    if front == "ddp":
        dp = DistributedDataParallel(model, **kwargs)
        reducer = dp.reducer
    else:
        dp = replicate(model, **kwargs)
        reducer = dp._replicate_state.reducer
    assert sum(b.buffer.numel() for b in reducer.buckets) == sum(
        p._local_tensor.numel() for p in model.parameters()), "buckets hold the local shards"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q, rtol=0, atol=0, msg=f"{name} after the start-up broadcast")
    if front == "ddp":
        torch.testing.assert_close(_full(model.shift), ref.shift, rtol=0, atol=0)
    else:  # torch's replicate syncs the parameters only: each rank keeps its own buffers
        assert (dp_rank == 0) == torch.equal(_full(model.shift), ref.shift), "replicate moved a buffer"
        with torch.no_grad():
            model.shift._local_tensor.copy_(ref.shift)  # what a replicate user does: start them equal
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = _batch(step, n_dp * PER_DP)
        mine = slice(dp_rank * PER_DP, (dp_rank + 1) * PER_DP)
        loss = F.cross_entropy(dp(x[mine]), y[mine])
        loss.backward()
        for name, p in model.named_parameters():
            if name.startswith("unused"):
                assert p.grad is None, "globally unused: its .grad stays None, as in torch"
                continue
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            assert_synced(p.grad._local_tensor, dp_group, name=f"{name}.grad")
        if view:
            for bucket in reducer.buckets:
                for p, v in zip(bucket.params, bucket.views):
                    if p.grad is not None:
                        assert p.grad._local_tensor.data_ptr() == v.data_ptr(), bucket.fqns
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        comm.all_reduce(mean, group=dp_group, op="avg")
        torch.testing.assert_close(mean.item(), ref_loss.item(), rtol=1e-5, atol=1e-7, msg=f"loss at step {step}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.placements == (LAYOUT[name],), "training must not move a parameter"
        torch.testing.assert_close(p.full_tensor(), q, atol=2e-5, rtol=1e-4, msg=f"{name} after {STEPS} steps")
        assert_synced(p._local_tensor, dp_group, name=name)


@distributed([2])
def test_dtensor_params_spread_over_dp_are_refused():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"weight is a DTensor .* shares global ranks \[\d\] with the data-parallel group \[0, 1\]"):
        DistributedDataParallel(model, device_mesh=mesh)
    with pytest.raises(ValueError, match="weight is a DTensor"):
        replicate(model, device_mesh=mesh)


@distributed([4])
@pytest.mark.parametrize("front", ["ddp", "replicate"])
def test_no_sync_accumulates_tp_gradients_then_reduces_the_sum(front):
    """Two micro-batches per dp rank, the first under no_sync: the gradients (DTensors,
    `scale`'s Partial over tp) accumulate locally, and the synced backward reduces their
    sum. Expected: the single-process gradient of the summed losses over the whole batch,
    divided by the dp size. Tolerance atol 1e-6, rtol 1e-5 (float32, one backward)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, n_dp = mesh.get_local_rank("dp"), mesh.size("dp")
    model = _tensor_parallel(_build(seed=0), mesh["tp"])
    ref = _build(seed=0)
    if front == "ddp":
        dp = DistributedDataParallel(model, device_mesh=mesh["dp"], find_unused_parameters=True)
    else:
        dp = replicate(model, device_mesh=mesh["dp"], find_unused_parameters=True)
    x, y = _batch(0, 2 * n_dp * PER_DP)
    micro = [slice((2 * dp_rank + k) * PER_DP, (2 * dp_rank + k + 1) * PER_DP) for k in range(2)]
    with dp.no_sync():
        F.cross_entropy(dp(x[micro[0]]), y[micro[0]]).backward()
    assert model.fc1.weight.grad is not None
    F.cross_entropy(dp(x[micro[1]]), y[micro[1]]).backward()
    for r in range(n_dp):  # the reference: every rank's two micro-batch losses, / n_dp
        for k in range(2):
            rows = slice((2 * r + k) * PER_DP, (2 * r + k + 1) * PER_DP)
            (F.cross_entropy(ref(x[rows]), y[rows]) / n_dp).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if name.startswith("unused"):
            continue
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-5, msg=name)
