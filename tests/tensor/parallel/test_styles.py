"""Each parallel style alone on a tiny module equals the unsharded module: forward output
and the gradients of the parameters and the input, on 1 to 4 ranks.

    ColwiseParallel / RowwiseParallel   nn.Linear (with bias) and nn.Embedding, default
                                        layouts and the others (Shard(1) outputs: a
                                        reduce-scatter; sharded or replicated inputs)
    SequenceParallel                    LayerNorm and RMSNorm with and without affine
                                        weights (their grads come out Partial and reduce
                                        to the right value), dropout (the same mask as one
                                        process: DTensor draws the whole tensor)
    PrepareModuleInput / Output         positional and keyword inputs, None entries left
                                        alone, use_local_output both ways

Widths 12 divide every world size (a local output must be an even piece); 7 (uneven) is
used where the output stays a DTensor. Tolerance 1e-5 (float32): sharded contractions and
the norm-weight grads sum in another order.
"""

import pytest
import torch
from torch import nn

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from plait.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from plait.testing import distributed

TOL = dict(atol=1e-5, rtol=1e-5)


def _mesh(world_size):
    return init_device_mesh("cpu", (world_size,))


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _piece(mesh, full, dim):
    return distribute_tensor(full, mesh, [Shard(dim)]).to_local()


def _full(t, mesh=None, dim=None):
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t if dim is None else DTensor.from_local(t, mesh, [Shard(dim)]).full_tensor()


def _check(mesh, make, style, full_in, *, in_dim=None, out_dim=None, grad_in=True, counts=None):
    """`make()` parallelized with `style` vs unsharded. The parallel input is the whole
    `full_in` (in_dim None) or its Shard(in_dim) piece; the output is whole or a
    Shard(out_dim) piece (or a DTensor)."""
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    mod = parallelize_module(make(), mesh, style)
    x_ref = full_in.clone().requires_grad_(grad_in and full_in.is_floating_point())
    x = (full_in if in_dim is None else _piece(mesh, full_in, in_dim)).clone()
    x.requires_grad_(x_ref.requires_grad)
    torch.manual_seed(3)
    want = ref(x_ref)
    torch.manual_seed(3)
    with CommDebugMode() as mode:
        got = mod(x)
    if counts is not None:
        assert dict(mode.get_comm_counts()) == counts, mode.get_comm_counts()
    torch.testing.assert_close(_full(got, mesh, out_dim), want, **TOL)
    w = _x(*want.shape, seed=9)
    (want * w).sum().backward()
    w_got = w if isinstance(got, DTensor) or out_dim is None else _piece(mesh, w, out_dim)
    if isinstance(got, DTensor):
        w_got = distribute_tensor(w, mesh, [Replicate() if got.placements[0].is_partial() else got.placements[0]])
    (got * w_got).sum().backward() if not isinstance(got, DTensor) else \
        (got * w_got).to_local().sum().backward()
    for (name, p), (_, q) in zip(mod.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")
    if x_ref.requires_grad:
        torch.testing.assert_close(_full(x.grad, mesh, in_dim), x_ref.grad, **TOL)
    return mod, got


@distributed([1, 2, 3, 4])
def test_colwise_linear(world_size):
    mesh = _mesh(world_size)
    x = _x(2, 3, 5)
    _check(mesh, lambda: nn.Linear(5, 12), ColwiseParallel(), x, out_dim=2, counts={})
    # uneven output features stay a DTensor; gathered output; a batch-sharded input
    _, got = _check(mesh, lambda: nn.Linear(5, 7), ColwiseParallel(use_local_output=False), x)
    assert got.placements == (Shard(2),)
    _check(mesh, lambda: nn.Linear(5, 7), ColwiseParallel(output_layouts=Replicate()), x)
    _check(mesh, lambda: nn.Linear(5, 12), ColwiseParallel(input_layouts=Shard(0)), _x(12, 3, 5), in_dim=0,
           out_dim=2, counts={"all_gather": 1})


@distributed([1, 2, 3, 4])
def test_rowwise_linear(world_size):
    mesh = _mesh(world_size)
    x = _x(2, 12, 12)
    mod, _ = _check(mesh, lambda: nn.Linear(12, 5), RowwiseParallel(), x, in_dim=2, counts={"all_reduce": 1})
    assert mod.weight.placements == (Shard(1),) and mod.bias.placements == (Replicate(),)
    _check(mesh, lambda: nn.Linear(12, 5), RowwiseParallel(output_layouts=Shard(1)), x, in_dim=2, out_dim=1,
           counts={"reduce_scatter": 1})
    _check(mesh, lambda: nn.Linear(12, 5), RowwiseParallel(input_layouts=Replicate()), x)  # cut locally
    _, got = _check(mesh, lambda: nn.Linear(12, 5, bias=False), RowwiseParallel(use_local_output=False), x, in_dim=2)
    assert got.placements == (Replicate(),)


@distributed([1, 2, 3, 4])
def test_embeddings(world_size):
    mesh = _mesh(world_size)
    ids = torch.randint(0, 10, (2, 12), generator=torch.Generator().manual_seed(2))
    mod, _ = _check(mesh, lambda: nn.Embedding(10, 12), ColwiseParallel(), ids, out_dim=2, counts={})
    assert mod.weight.placements == (Shard(1),)
    _check(mesh, lambda: nn.Embedding(10, 7), ColwiseParallel(output_layouts=Replicate()), ids)
    # vocabulary rows sharded (10 on 3 and 4 ranks: uneven): Partial -> all-reduce / reduce-scatter
    mod, _ = _check(mesh, lambda: nn.Embedding(10, 6), RowwiseParallel(input_layouts=Replicate()), ids,
                    counts={"all_reduce": 1})
    assert mod.weight.placements == (Shard(0),)
    _check(mesh, lambda: nn.Embedding(10, 6, padding_idx=3),
           RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), ids, out_dim=1,
           counts={"reduce_scatter": 1})
    # torch's default input layout is Shard(-1) even for an embedding: the ids are gathered
    _check(mesh, lambda: nn.Embedding(10, 6), RowwiseParallel(), ids, in_dim=1,
           counts={"all_gather": 1, "all_reduce": 1})


NORMS = {
    "layer_norm": lambda: nn.LayerNorm(6),
    "layer_norm_no_bias": lambda: nn.LayerNorm(6, bias=False),
    "layer_norm_no_affine": lambda: nn.LayerNorm(6, elementwise_affine=False),
    "rms_norm": lambda: nn.RMSNorm(6),
    "rms_norm_no_affine": lambda: nn.RMSNorm(6, elementwise_affine=False),
}


def _affine(make):
    def build():
        m = make()
        for p in m.parameters():  # weights and biases away from 1 and 0
            nn.init.uniform_(p, 0.5, 1.5)
        return m
    return build


@distributed([1, 2, 3, 4])
@pytest.mark.parametrize("norm", list(NORMS))
def test_sequence_parallel_norms(world_size, norm):
    mesh = _mesh(world_size)
    x = _x(2, 12, 6) * 2 + 1
    mod, got = _check(mesh, _affine(NORMS[norm]), SequenceParallel(), x, in_dim=1, counts={})
    assert isinstance(got, DTensor) and got.placements == (Shard(1),)
    for p in mod.parameters():  # Replicate parameters, Partial grads (summed over the ranks' sequence)
        assert p.placements == (Replicate(),)
        assert p.grad.placements == (Partial(),)
    _check(mesh, _affine(NORMS[norm]), SequenceParallel(use_local_output=True), x, in_dim=1, out_dim=1)
    # a (B, S, D) DTensor input laid out otherwise is moved to the sequence sharding
    _check(mesh, _affine(NORMS[norm]), SequenceParallel(sequence_dim=0), _x(12, 2, 6), in_dim=0)


@distributed([2, 3])
def test_sequence_parallel_dropout_and_dtensor_input(world_size):
    mesh = _mesh(world_size)
    x = _x(2, 12, 6)
    drop = lambda: nn.Dropout(0.5)  # noqa: E731
    _check(mesh, drop, SequenceParallel(use_local_output=True), x, in_dim=1, out_dim=1)
    mod = parallelize_module(nn.LayerNorm(6), mesh, SequenceParallel())
    replicated = distribute_tensor(x, mesh, [Replicate()])
    with CommDebugMode() as mode:
        out = mod(replicated)  # Replicate -> Shard(1): a local cut
    assert out.placements == (Shard(1),) and mode.get_total_counts() == 0
    torch.testing.assert_close(out.full_tensor(), nn.LayerNorm(6)(x), **TOL)


class TwoInputs(nn.Module):
    def forward(self, x, y, *, mask=None, scale=None):
        assert isinstance(x, self.expect) and not isinstance(y, DTensor) and not isinstance(scale, DTensor)
        if isinstance(x, DTensor):
            assert x.placements == (Replicate(),) and mask.placements == (Replicate(),)
            x, mask = x.to_local(), mask.to_local()
        return x * y * mask * scale


@distributed([1, 2, 3])
@pytest.mark.parametrize("use_local_output", [False, True])
def test_prepare_module_input_with_kwargs(world_size, use_local_output):
    mesh = _mesh(world_size)
    x, y, mask = _x(6, 4, seed=1), _x(6, 4, seed=2), _x(6, 4, seed=3)
    mod = TwoInputs()
    mod.expect = torch.Tensor if use_local_output else DTensor
    style = PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
                               input_kwarg_layouts={"mask": Shard(0)}, desired_input_kwarg_layouts={"mask": Replicate()},
                               use_local_output=use_local_output)
    parallelize_module(mod, mesh, style)
    xs = _piece(mesh, x, 0).requires_grad_()
    with CommDebugMode() as mode:
        out = mod(xs, y, mask=_piece(mesh, mask, 0), scale=2.0)
    assert mode.get_comm_counts()["all_gather"] == 2
    torch.testing.assert_close(out, x * y * mask * 2.0, **TOL)
    out.sum().backward()  # the grad of a Replicate value is Replicate: each rank keeps its piece
    torch.testing.assert_close(xs.grad, _piece(mesh, y * mask * 2.0, 0), **TOL)


class Pair(nn.Module):
    def forward(self, a, b):
        return a * 2, b + 1


@distributed([1, 2, 3])
def test_prepare_module_output(world_size):
    mesh = _mesh(world_size)
    a, b = _x(6, 4, seed=1), _x(6, 4, seed=2)
    mod = parallelize_module(Pair(), mesh, PrepareModuleOutput(output_layouts=(Shard(0), None),
                                                               desired_output_layouts=(Replicate(), None)))
    got_a, got_b = mod(_piece(mesh, a, 0), b)
    assert not isinstance(got_a, DTensor) and not isinstance(got_b, DTensor)
    torch.testing.assert_close(got_a, a * 2, **TOL)
    torch.testing.assert_close(got_b, b + 1, **TOL)
    one = parallelize_module(nn.Identity(), mesh, PrepareModuleOutput(
        output_layouts=Shard(0), desired_output_layouts=Replicate(), use_local_output=False))
    out = one(_piece(mesh, a, 0))
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), a, **TOL)
    both = parallelize_module(nn.Identity(), mesh, PrepareModuleInputOutput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(), output_layouts=Replicate(),
        desired_output_layouts=Shard(1)))
    out = both(_piece(mesh, a, 0))  # gathered on the way in, cut on dim 1 on the way out
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, _piece(mesh, a, 1), **TOL)
