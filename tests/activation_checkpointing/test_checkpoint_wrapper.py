"""checkpoint_wrapper / apply_activation_checkpointing: what autograd saves, the numbers
(equal to training without checkpointing) and the names (no wrapper prefix).

Saved activations are observed with torch.autograd.graph.saved_tensors_hooks: the outer
pack hook sees every tensor autograd keeps for backward outside a checkpointed region;
inside one, torch.utils.checkpoint keeps nothing but the region's inputs. So the count with
checkpointing must be the count without, minus what each wrapped block saves on its own.

Training equality is exact (atol=rtol=0): the recompute runs the same CPU kernels on the
same inputs in the same order, so its activations, and so every gradient, are bitwise the
ones the plain forward produced.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.activation_checkpointing import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from plait.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
from plait.models.llama import CONFIGS, Transformer, TransformerBlock

PREFIX = "_checkpoint_wrapped_module"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x))) * scale  # (B, d)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 9)
        self.blocks = nn.ModuleList([Block(9) for _ in range(3)])
        self.head = nn.Linear(9, 4)
        self.register_buffer("bias", torch.linspace(-1, 1, 9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.bias
        for b in self.blocks:
            h = b(h, scale=0.5)
        return self.head(h)


def saved(fn) -> list[torch.Tensor]:
    """The tensors autograd saves for backward while `fn()` runs (outside checkpointed
    regions: torch.utils.checkpoint's own hooks take those)."""
    out = []

    def pack(t):
        out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return out


def clean(fqn: str) -> str:
    return fqn.replace(PREFIX + ".", "")


def net_and_copy(seed: int = 0):
    torch.manual_seed(seed)
    net = Net()
    return net, copy.deepcopy(net)


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_saves_only_block_inputs(impl):
    plain, ckpt = net_and_copy()
    apply_activation_checkpointing(
        ckpt, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, Block))
    assert all(isinstance(b, CheckpointWrapper) for b in ckpt.blocks)
    x = torch.randn(6, 5, requires_grad=True)
    h = torch.randn(6, 9, requires_grad=True)
    per_block = len(saved(lambda: plain.blocks[0](h, scale=0.5).sum()))
    assert per_block == 4  # addmm's input and weight, tanh's output, dropout's mask
    without = saved(lambda: plain(x).sum())
    block_inputs = []
    for b in ckpt.blocks:
        b.register_forward_pre_hook(lambda m, args: block_inputs.append(args[0]))
    with_ac = saved(lambda: ckpt(x).sum())
    # each block keeps only its input (one tensor) instead of its 4 activations
    assert len(with_ac) == len(without) - 3 * per_block + 3
    ids = [id(t) for t in with_ac]
    assert all(id(t) in ids for t in block_inputs)
    assert not any(t.grad_fn is not None and "Tanh" in type(t.grad_fn).__name__ for t in with_ac)


def test_recomputes_in_backward():
    """Each block's forward runs again inside backward, once."""
    _, ckpt = net_and_copy()
    apply_activation_checkpointing(ckpt, check_fn=lambda m: isinstance(m, Block))
    calls = []
    for i, b in enumerate(ckpt.blocks):
        # a pre-hook: the recompute stops early, once it rebuilt what backward needs
        b._checkpoint_wrapped_module.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    loss = ckpt(torch.randn(4, 5)).sum()
    assert calls == [0, 1, 2]
    loss.backward()
    assert sorted(calls[3:]) == [0, 1, 2]


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_trains_equal_to_without(impl):
    """5 AdamW steps with dropout (the recompute replays the RNG state): exactly equal."""
    plain, ckpt = net_and_copy()
    apply_activation_checkpointing(
        ckpt, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, Block))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, ckpt)]
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, generator=gen), torch.randint(4, (8,), generator=gen)
        losses = []
        for model, opt in zip((plain, ckpt), opts):
            torch.manual_seed(100 + step)  # the same dropout masks for both
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    for (name, p), (cname, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert name == clean(cname)
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_llama_trains_equal_and_keeps_names():
    """The reference Llama with every TransformerBlock checkpointed (auto_wrap_policy form)."""
    torch.manual_seed(0)
    plain = Transformer(CONFIGS["tiny"])
    plain.init_weights(seed=0)
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(
        ckpt, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                 transformer_layer_cls={TransformerBlock}))
    assert all(isinstance(b, CheckpointWrapper) for b in ckpt.layers.values())
    assert [clean(n) for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, ckpt)]
    tokens = torch.randint(128, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        losses = []
        for model, opt in zip((plain, ckpt), opts):
            logits = model(tokens[:, :-1])  # (2, 16, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]


def test_state_dict_without_prefix_loads_both_ways():
    plain, ckpt = net_and_copy()
    apply_activation_checkpointing(ckpt, check_fn=lambda m: isinstance(m, Block))
    sd = ckpt.state_dict()
    assert not any(PREFIX in k for k in sd), list(sd)
    assert list(sd) == list(plain.state_dict())
    # the wrapper's own named_parameters drops the prefix; a parent's keeps it, as torch's
    assert [n for n, _ in ckpt.blocks[0].named_parameters()] == ["lin.weight", "lin.bias"]
    assert [n for n, _ in ckpt.named_parameters()][2] == f"blocks.0.{PREFIX}.lin.weight"
    # a plain model's state dict loads into the checkpointed one, and back
    other, _ = net_and_copy(seed=1)
    ckpt.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        torch.testing.assert_close(ckpt.state_dict()[k], v, atol=0, rtol=0)
    plain.load_state_dict(ckpt.state_dict())
    # a state dict keyed with the wrapper's names (as nn.Module would write it) loads too
    raw = {k.replace("blocks.0.", f"blocks.0.{PREFIX}."): v for k, v in other.state_dict().items()}
    ckpt.load_state_dict(raw)
    # the wrapped module's attributes show through the wrapper
    assert ckpt.blocks[0].lin is ckpt.blocks[0]._checkpoint_wrapped_module.lin


def test_matches_torch_wrapper_names():
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw

    ours, theirs = net_and_copy()
    apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, Block))
    torch_cw.apply_activation_checkpointing(theirs, check_fn=lambda m: isinstance(m, Block))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.blocks[0].named_parameters()] == \
        [n for n, _ in theirs.blocks[0].named_parameters()]
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]


def test_policy_forms_and_idempotence():
    _, a = net_and_copy()
    apply_activation_checkpointing(a, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert all(isinstance(b, CheckpointWrapper) for b in a.blocks)
    assert not isinstance(a.head, CheckpointWrapper) and not isinstance(a, CheckpointWrapper)
    apply_activation_checkpointing(a, check_fn=lambda m: isinstance(m, Block))  # nothing new
    assert all(not isinstance(b._checkpoint_wrapped_module, CheckpointWrapper) for b in a.blocks)
    with pytest.raises(ValueError, match="wrapped in a CheckpointWrapper already"):
        checkpoint_wrapper(a.blocks[0])
    with pytest.raises(TypeError, match="CheckpointImpl"):
        checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl="no_reentrant")


def test_offload_wrapper_saves_on_cpu_and_keeps_numbers():
    plain, off = net_and_copy()
    off.blocks[1] = offload_wrapper(off.blocks[1])
    x = torch.randn(4, 5)
    torch.manual_seed(3)
    a = plain(x)
    torch.manual_seed(3)
    b = off(x)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert list(off.state_dict()) == list(plain.state_dict())
