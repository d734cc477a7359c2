"""context_parallel: shard the sequence over a 1-D `cp` mesh and make SDPA ring attention.

    with context_parallel(mesh["cp"], buffers=[tokens, labels, rope], buffer_seq_dims=[1, 1, 0],
                          no_restore_buffers={tokens, labels}):
        loss = loss_fn(model(tokens), labels)   # every F.scaled_dot_product_attention is a ring
        loss.backward()
    full = context_parallel_unshard(mesh["cp"], [out], [2])[0]   # back in sequence order

Data flow on entry: each buffer (every rank passes the same full tensor) is replaced in place
(`resize_` + `copy_`, as torch does, so a module's registered buffer is sharded too) by the
positions its rank holds, `ring_plan.local_positions`: chunks r and 2*cp-1-r of 2*cp when
load balanced (the default, torch's head-tail balancer), chunk r of cp otherwise. Inside the
block a TorchFunctionMode turns each `F.scaled_dot_product_attention(q, k, v, is_causal=...)`
into `ring_attention` on the mesh's group; a function mode sees the call however the model
imported it, and F's name itself is patched too (as torch does) for the recomputation that
activation checkpointing runs in backward, outside any function mode. It composes with
autograd (the ring is an autograd.Function) and with DTensor (a DTensor input sharded on
batch or heads, TP's local heads, runs on its local piece and is wrapped back with its
placements). On exit every buffer not in `no_restore_buffers` gets
its original contents back. `set_rotate_method` picks the K/V rotation for later calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from plait import comm
from plait.tensor.experimental import ring_attention as ring
from plait.tensor.experimental.ring_plan import check_seq_len, local_positions, shard_indices


@dataclass
class _ContextParallelOptions:
    """torch's `_cp_options`: read when a ring runs (rotation) or a buffer is sharded (layout)."""

    rotate_method: str = "allgather"  # torch's default
    enable_load_balance: bool = True


_cp_options = _ContextParallelOptions()


def set_rotate_method(rotate_method: str) -> None:
    """How K/V travel: "allgather" (gather all blocks once) or "alltoall" (p2p ring passing,
    each transfer overlapped with the block compute)."""
    if rotate_method not in ring.ROTATE_METHODS:
        raise ValueError(f"set_rotate_method takes one of {ring.ROTATE_METHODS}, got {rotate_method!r}")
    _cp_options.rotate_method = rotate_method


def _cp_group(mesh):
    if mesh.ndim != 1:
        raise ValueError(f"context parallel takes a 1-D mesh (the cp axis), got a {mesh.ndim}-D mesh of shape "
                         f"{tuple(mesh.shape)}; pass mesh['cp']")
    return mesh.get_group()


def _check_buffers(buffers: Sequence[torch.Tensor], seq_dims: Sequence[int] | None, cp: int,
                   load_balance: bool, name: str) -> list[int]:
    if seq_dims is None or len(seq_dims) != len(buffers):
        got = "none" if seq_dims is None else len(seq_dims)
        raise ValueError(f"{name}: {len(buffers)} buffers but {got} sequence dims; give each buffer its "
                         f"sequence dim")
    dims = []
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(b, torch.Tensor) or isinstance(b, torch.nn.Parameter):
            raise TypeError(f"{name}: buffer {i} is a {type(b).__name__}; buffers are plain tensors, "
                            f"not parameters")
        if b.requires_grad:  # resize_ cannot change a tensor autograd tracks
            raise ValueError(f"{name}: buffer {i} requires grad; pass the data (inputs, labels, tables), "
                             f"e.g. its .detach()")
        if not isinstance(d, int) or not -b.dim() <= d < max(b.dim(), 1) or b.dim() == 0:
            raise ValueError(f"{name}: buffer {i} of shape {tuple(b.shape)} has no sequence dim {d}")
        d %= b.dim()
        check_seq_len(b.size(d), cp, load_balance=load_balance, what=f"buffer {i}'s sequence (dim {d})")
        dims.append(d)
    return dims


@contextlib.contextmanager
def context_parallel(
    mesh,
    *,
    buffers: list[torch.Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:
    """Shard `buffers` on their sequence dims over `mesh` in place and run SDPA as ring
    attention inside the block; restore the buffers (but `no_restore_buffers`) on exit."""
    group = _cp_group(mesh)
    cp, rank = comm.get_world_size(group), comm.get_rank(group)
    buffers = [] if buffers is None else list(buffers)
    no_restore = [] if no_restore_buffers is None else list(no_restore_buffers)
    load_balance = _cp_options.enable_load_balance
    dims = _check_buffers(buffers, buffer_seq_dims if buffers else [], cp, load_balance, "context_parallel")
    lengths = sorted({b.size(d) for b, d in zip(buffers, dims)})
    if len(lengths) > 1:  # one layout for everything: a rope table must be cut to the sequence
        raise ValueError(f"context_parallel: buffers have sequence lengths {lengths}; they must share one "
                         f"(slice a positional table to the input's length)")
    for b in no_restore:
        if not any(b is x for x in buffers):  # `in` would compare tensors elementwise
            raise ValueError("context_parallel: no_restore_buffers must be a subset of buffers")
    originals = [None if any(b is x for x in no_restore) else b.clone() for b in buffers]
    with torch.no_grad():
        for b, d in zip(buffers, dims):
            shard = b.index_select(d, local_positions(rank, cp, b.size(d), load_balance=load_balance).to(b.device))
            b.resize_(shard.shape)
            b.copy_(shard)
    try:
        with _ring_sdpa(group, load_balance):
            yield
    finally:
        with torch.no_grad():
            for b, original in zip(buffers, originals):
                if original is not None:
                    b.resize_(original.shape)
                    b.copy_(original)


def context_parallel_unshard(mesh, buffers: list[torch.Tensor], seq_dims: list[int]) -> list[torch.Tensor]:
    """Gather `buffers` (sharded as context_parallel shards) back to the full sequence, in order."""
    group = _cp_group(mesh)
    cp = comm.get_world_size(group)
    load_balance = _cp_options.enable_load_balance
    dims = _check_buffers(buffers, seq_dims, 1, False, "context_parallel_unshard")
    out = []
    with torch.no_grad():
        for b, d in zip(buffers, dims):
            full = comm.all_gather(b.contiguous(), group=group, dim=d) if cp > 1 else b.clone()
            order = shard_indices(cp, full.size(d), load_balance=load_balance).to(b.device)
            out.append(full.index_select(d, torch.argsort(order)))  # gathered slot j holds position order[j]
    return out


def _sdpa_args(args: tuple, kwargs: dict) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


_NATIVE_SDPA = torch._C._nn.scaled_dot_product_attention  # what F's name is outside any block


class _RingSDPA:
    """F.scaled_dot_product_attention's signature and checks, computed by ring_attention on `group`."""

    def __init__(self, group, load_balance: bool) -> None:
        self.group, self.load_balance = group, load_balance

    def __call__(self, *args, **kwargs):
        a = _sdpa_args(args, kwargs)
        if a["attn_mask"] is not None:
            raise ValueError(f"context parallel SDPA supports is_causal=True or no mask, got an attn_mask of "
                             f"shape {tuple(a['attn_mask'].shape)}; express it as is_causal")
        if a["dropout_p"]:
            raise ValueError(f"context parallel SDPA does not support dropout, got dropout_p={a['dropout_p']}")
        q, k, v = a["query"], a["key"], a["value"]
        if q.size(-3) != k.size(-3) and not a["enable_gqa"]:
            raise ValueError(f"SDPA got {q.size(-3)} query heads and {k.size(-3)} key/value heads; pass "
                             f"enable_gqa=True for grouped-query attention")
        (ql, kl, vl), rewrap = _locals(q, k, v)
        out = ring.ring_attention(ql, kl, vl, group=self.group, is_causal=bool(a["is_causal"]),
                                  scale=a["scale"], load_balance=self.load_balance,
                                  rotate_method=_cp_options.rotate_method)
        return rewrap(out)


class _RingAttentionMode(TorchFunctionMode):
    """SDPA however it was imported (`from torch.nn.functional import ...` too) -> the ring."""

    def __init__(self, sdpa: _RingSDPA) -> None:
        super().__init__()
        self.sdpa = sdpa

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _NATIVE_SDPA:
            return self.sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _ring_sdpa(group, load_balance: bool) -> Iterator[None]:
    """Both doors to SDPA lead to the ring inside the block: the function mode, and F's name
    itself (torch's monkey patch), because a block that activation checkpointing recomputes
    in backward runs outside any torch function mode but still looks F's name up."""
    sdpa = _RingSDPA(group, load_balance)
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        with _RingAttentionMode(sdpa):
            yield
    finally:
        F.scaled_dot_product_attention = saved


def _locals(q, k, v):
    """Local pieces of q, k, v and how to wrap the output back (DTensors on batch/heads)."""
    from plait.tensor import DTensor, Shard
    from plait.tensor.placement import Replicate

    dts = [t for t in (q, k, v) if isinstance(t, DTensor)]
    if not dts:
        return (q, k, v), lambda out: out
    if len(dts) != 3:
        raise TypeError("context parallel SDPA got a mix of DTensor and plain q, k, v; pass all or none")
    for t in dts:
        for p in t.placements:
            if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % 4 in (0, 1))):
                raise ValueError(f"context parallel SDPA runs DTensors sharded on batch or heads (dims 0, 1) or "
                                 f"replicated, got placements {t.placements}; the sequence is sharded by cp")
    mesh, placements = q.device_mesh, q.placements
    return tuple(t.to_local() for t in dts), lambda out: DTensor.from_local(out, mesh, placements)
