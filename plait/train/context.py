"""One step's batch under context parallel: each cp rank holds 2 of 2*cp sequence chunks.

    batch slice (b, s+1) -> x, y (b, s) and each stage module's rotary rows (s, hd/2, 2)
    -> context_parallel(mesh.cp, buffers=[x, y, rope...]): each sharded to this rank's chunks
       i and 2*cp-1-i (so a module's rotary rows are the positions of its tokens)
    -> inside the block: forward (every SDPA is exact ring attention over cp), local mean
       loss, backward (a block recomputed by activation checkpointing meets the ring too);
       with pp > 1 the schedule runs there, sending (b, s/cp, dim) activations between stages

Every cp rank holds the same number of tokens, so the mean of the cp ranks' local losses is
the batch slice's loss, and FSDP's gradient average over the flattened (dp_shard, cp) axis is
the gradient of that mean: the ring's backward already carried each rank's dK/dV home.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from plait.tensor.experimental import context_parallel


@contextlib.contextmanager
def cp_batch(modules: Sequence[torch.nn.Module], x: torch.Tensor, y: torch.Tensor, *,
             mesh) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Inside: (x, y) cut to this cp rank's chunks, each module's rope_cache to their rows, SDPA a ring."""
    ropes = [m.rope_cache for m in modules]  # (max_seq_len, hd/2, 2): the model reads rows [:s]
    tables = [r[: x.size(1)].clone() for r in ropes]
    x, y = x.contiguous().clone(), y.contiguous().clone()
    for m, table in zip(modules, tables):
        m.rope_cache = table  # sharded with the tokens below: row j is local token j's position
    buffers = [x, y, *tables]
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1] + [0] * len(tables),
                              no_restore_buffers=set(buffers)):
            yield x, y
    finally:
        for m, rope in zip(modules, ropes):
            m.rope_cache = rope
