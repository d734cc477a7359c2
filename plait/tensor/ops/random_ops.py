"""Random ops: bernoulli (what dropout draws on CPU), uniform_, normal_, exponential_,
cauchy_, geometric_, log_normal_, random_, rand_like, randn_like, randint_like, native_dropout.

Each rank draws the WHOLE global tensor with the same generator calls a single-process
run would make, then keeps its piece: a Replicate result is identical on every rank and
a sharded one is exactly the piece of the single-process draw, uneven shards included.
That costs a full-size draw per rank; a counter-based generator (CUDA's Philox) could
draw just the piece at an offset instead.  TODO(GPU): offset-based draws on CUDA.

Ranks must start from the same generator state, as a single-process run has one: the
first random op on a mesh copies coordinate 0's default generator state to every rank
(torch's DTensor does the same on CUDA). A `generator=` the caller passes is used as is.
Probability tensors (bernoulli(p)) are gathered; a Partial self cannot hold random
values, so in-place draws on one are refused and *_like ops return Replicate.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.tensor.ops.registry import OpCall, Sharding, aten, overloads, register
from plait.tensor.placement import Partial, Replicate

_synced: set = set()


def sync_generator(mesh, device: torch.device, force: bool = False) -> None:
    """Give every rank of `mesh` coordinate 0's default generator state (once per mesh, or
    again with `force`)."""
    key = (mesh, device.type)
    if key in _synced and not force:
        return
    _synced.add(key)
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            state = comm.broadcast(state.clone(), src=0, group=mesh.get_group(axis))
    if cuda:
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def mark_synced(mesh, device_type: str) -> None:
    """Every rank of `mesh` was seeded alike (tensor._random.manual_seed): no broadcast."""
    _synced.add((mesh, device_type))


def _piece(full: torch.Tensor, spec_shape, offsets, sizes) -> torch.Tensor:
    for d, (start, size) in enumerate(zip(offsets, sizes)):
        if size != spec_shape[d]:
            full = full.narrow(d, start, size)
    return full


def _out_placements(placements):
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def random_rule(call: OpCall) -> Sharding:
    spec = call.specs[0]
    in_place = 0 in call.mutated
    if in_place and spec.has_partial():
        raise ValueError(f"{call.op} draws into a Partial DTensor, whose value is a sum over ranks; "
                         "redistribute it to Replicate or Shard first")
    outs = _out_placements(spec.placements)
    out_spec = spec.with_placements(outs)
    offsets, sizes = out_spec.local_offset, out_spec.local_shape
    shape, stride, mesh, op = tuple(spec.shape), spec.stride, call.mesh, call.op
    # the self tensor of bernoulli(self) holds probabilities: gather it; other tensor args too
    reads_self = op in (aten.bernoulli.default,)
    replicate = tuple(Replicate() for _ in spec.placements)
    inputs = tuple(replicate if (k > 0 or reads_self) else None for k in range(len(call.specs)))
    has_generator = call.kwargs.get("generator") is not None

    def run(args, kwargs):
        x = args[0]
        if not has_generator:
            sync_generator(mesh, x.device)
        full = x if reads_self else torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device)
        result = op(full, *args[1:], **kwargs)
        piece = _piece(result, shape, offsets, sizes)
        if in_place:
            return x.copy_(piece)
        return piece if piece.numel() == result.numel() else piece.clone()  # free the rest

    return Sharding(inputs, (outs,) if call.outs else (), run)


RANDOM_OPS = (
    overloads(aten.bernoulli_, aten.bernoulli, aten.uniform_, aten.normal_, aten.exponential_,
              aten.random_, aten.rand_like, aten.randn_like, aten.randint_like, aten.cauchy_,
              aten.geometric_, aten.log_normal_)
)
register(*[op for op in RANDOM_OPS if "out" not in op._overloadname])(random_rule)


@register(aten.native_dropout.default)
def native_dropout_rule(call: OpCall) -> Sharding:
    """The mask comes from native_dropout itself run on ones of the global shape (the
    kernel's draws depend on the shape, not the values; CUDA's fused kernel draws its own
    way), so every device gets the single-process mask; this rank applies its piece."""
    spec = call.specs[0]
    p, train = call.args[1], call.arg(2, "train", True)
    outs = spec.placements  # dropout is linear in x for a fixed mask: Partial passes
    mask_spec = spec.with_placements(_out_placements(outs))
    offsets, sizes = mask_spec.local_offset, mask_spec.local_shape
    shape, mesh, op = tuple(spec.shape), call.mesh, call.op
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep

    def run(args, kwargs):
        x = args[0]
        if train is False:
            return op(x, p, train)
        sync_generator(mesh, x.device)
        _, full_mask = op(torch.ones(shape, dtype=x.dtype, device=x.device), p, train)
        mask = _piece(full_mask, shape, offsets, sizes)
        return x.mul(mask).mul_(scale), mask

    return Sharding((None,), (outs, mask_spec.placements), run)


__all__ = ["RANDOM_OPS", "mark_synced", "random_rule", "sync_generator"]
