"""One forward/backward under context parallel: each cp rank holds 2 of 2*cp sequence chunks.

    batch slice (b, s+1) -> x, y (b, s) and the rotary rows (s, hd/2, 2)
    -> context_parallel(mesh.cp, buffers=[x, y, rope]): each sharded to this rank's chunks
       i and 2*cp-1-i (so the rotary rows are the positions of its tokens)
    -> model(x): every SDPA is exact ring attention over cp -> local mean loss -> backward
       (inside the block: a recomputed block under activation checkpointing meets the ring too)

Every cp rank holds the same number of tokens, so the mean of the cp ranks' local losses is
the batch slice's loss, and FSDP's gradient average over the flattened (dp_shard, cp) axis is
the gradient of that mean: the ring's backward already carried each rank's dK/dV home.
"""

from __future__ import annotations

import torch

from plait.tensor.experimental import context_parallel


def cp_forward_backward(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, mesh, loss_fn,
                        train: bool) -> torch.Tensor:
    """The local mean loss of this cp rank's chunks of (x, y); backward when `train`."""
    rope = module.rope_cache  # (max_seq_len, hd/2, 2): the model reads rows [:s] of it
    table = rope[: x.size(1)].clone()
    x, y = x.contiguous().clone(), y.contiguous().clone()
    module.rope_cache = table  # sharded with the tokens below: row j is local token j's position
    try:
        with context_parallel(mesh, buffers=[x, y, table], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={x, y, table}):
            loss = loss_fn(module(x), y)
            if train:
                loss.backward()
    finally:
        module.rope_cache = rope
    return loss
