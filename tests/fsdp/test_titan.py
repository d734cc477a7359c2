"""What torchtitan's trainer asks of fully_shard beyond the common loop, on plait and on torch
in the same test, both against a single-process reference:

- the chunked loss: fully_shard([norm, head]) as one group, the model's forward runs norm
  only, the loss calls head on each chunk of the detached hidden states with its own
  backward, then the hidden states' gradient goes back through norm and the trunk;
- set_gradient_divide_factor(1.0) on every FSDPModule (torchtitan divides its loss by the
  global token count instead) with set_force_sum_reduction_for_comms(True) (Gloo has no
  PREMUL_SUM): the gradients are the sum over ranks, not the mean.

Tolerance 1e-5: the same float32 math on the same slices; a missing gather (the old failure),
a chunk's gradient dropped or a 1/N too many is off by far more.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.testing import distributed
from tests.fsdp.common import PER_RANK, Block, make_opt, mine, world

CHUNKS = 3


class Trunk(nn.Module):
    """torchtitan's Llama in miniature: blocks, a final norm, an output head (dims 7, 13, 9:
    none divides by 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList([Block(13, 13), Block(13, 13)])
        self.norm = nn.LayerNorm(13)
        self.head = nn.Linear(13, 9, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 7) -> (B, 13), head skipped
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def _chunked_loss_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """torchtitan's ChunkedCELoss: head per chunk with an immediate backward into the detached
    hidden states, then one backward of the trunk with their accumulated gradient."""
    h = model(x)  # (B, 13)
    h_det = h.detach().requires_grad_()
    total = torch.zeros(())
    for hc, yc in zip(h_det.chunk(CHUNKS), y.chunk(CHUNKS)):
        loss = F.cross_entropy(model.head(hc), yc, reduction="sum") / len(y)  # (b, 9) logits
        loss.backward()
        total += loss.detach()
    h.backward(h_det.grad)
    return total


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(n * PER_RANK, 7, generator=gen), torch.randint(9, (n * PER_RANK,), generator=gen)


def _shard(api: str, model: nn.Module, n: int) -> nn.Module:
    if api == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    else:
        from plait.device_mesh import init_device_mesh
        from plait.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (n,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.full_tensor() for k, p in model.named_parameters()}


@distributed([2])
def test_chunked_loss_with_norm_and_head_in_one_group():
    _, rank, n = world()
    torch.manual_seed(0)
    ref = Trunk()
    sharded = {}
    for api in ("torch", "plait"):
        torch.manual_seed(0)
        sharded[api] = _shard(api, Trunk(), n)
    opts = {api: make_opt(m.parameters()) for api, m in sharded.items()}
    ref_opt = make_opt(ref.parameters())
    for step in range(2):
        x, y = _batch(step, n)
        _chunked_loss_step(ref, x, y)  # the whole batch: the mean of the ranks' slice means
        want = {k: p.grad for k, p in ref.named_parameters()}
        for api, model in sharded.items():
            _chunked_loss_step(model, mine(x, rank), mine(y, rank))
            got = _grads(model)
            assert got.keys() == want.keys()
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, api=api, s=step: f"{api}, step {s}: grad of {k}: {m}")
            opts[api].step()
            opts[api].zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()


@distributed([2])
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_gradient_divide_factor_with_sum_only_reductions(factor):
    _, rank, n = world()
    torch.manual_seed(0)
    ref = Trunk()
    x, y = _batch(0, n)
    F.cross_entropy(ref.head(ref(x)), y).backward()  # mean over the batch = mean over ranks
    for api in ("torch", "plait"):
        torch.manual_seed(0)
        model = _shard(api, Trunk(), n)
        fsdp_modules = [m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")]
        assert len(fsdp_modules) == 5, api  # two blocks, norm and head (one group), the root
        for m in fsdp_modules:
            m.set_gradient_divide_factor(factor)
            m.set_force_sum_reduction_for_comms(True)
        F.cross_entropy(model.head(model(mine(x, rank))), mine(y, rank)).backward()
        for k, p in model.named_parameters():  # sum of the ranks' grads, divided by factor
            want = ref.get_parameter(k).grad * n / factor
            torch.testing.assert_close(p.grad.full_tensor(), want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, api=api: f"{api}: grad of {k}: {m}")
