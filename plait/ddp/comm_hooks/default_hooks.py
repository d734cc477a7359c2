"""The built-in comm hooks that reduce a bucket as a whole: plain average and 16-bit.

    hook(state, bucket) -> Future[Tensor]  (the reducer copies the value into the bucket)
    allreduce_hook:      buffer / N -> all-reduce(sum)              -> averaged buffer
    fp16/bf16 hook:      buffer -> cast, / N -> all-reduce(sum) in 16 bits -> cast back
    *_compress_wrapper:  any hook run on a 16-bit copy of the buffer, cast back after

`state` is the process group to reduce over, as in torch; None means the group DDP uses
(torch falls back to the world, which is wrong for DDP on a sub-group). Every collective
goes through `plait.comm`, so CommDebugMode counts a 16-bit hook's halved bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait import comm
from plait.ddp.buckets import GradBucket

Hook = Callable[[Any, GradBucket], torch.futures.Future]


def _group(process_group: ProcessGroup | None, bucket: GradBucket) -> ProcessGroup:
    return process_group if process_group is not None else bucket.process_group


def future_value(fut: torch.futures.Future) -> torch.Tensor:
    """A future's tensor, whether it holds the tensor or a one-element list (c10d's style)."""
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


def allreduce_fut(group: ProcessGroup, tensor: torch.Tensor) -> torch.futures.Future:
    """Average `tensor` over `group` in place; the future holds it."""
    tensor.div_(comm.get_world_size(group))
    return comm.all_reduce(tensor, group=group, op="sum", async_op=True).get_future()


def allreduce_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """The default reduction as a hook: the result equals DDP without a hook (up to the
    rounding of x / N against x * (1 / N))."""
    return allreduce_fut(_group(process_group, bucket), bucket.buffer())


def _compress_hook(dtype: torch.dtype, process_group: ProcessGroup | None,
                   bucket: GradBucket) -> torch.futures.Future:
    group = _group(process_group, bucket)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(comm.get_world_size(group))  # divide first: the sum stays in range

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(future_value(fut))
        return buffer

    return comm.all_reduce(compressed, group=group, op="sum", async_op=True).get_future().then(decompress)


def fp16_compress_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in float16: half the bytes, ~3 significant digits."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in bfloat16: half the bytes, float32's range, ~2 digits."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


def _compress_wrapper(dtype: torch.dtype, hook: Hook, name: str) -> Hook:
    def wrapper_hook(hook_state: Any, bucket: GradBucket) -> torch.futures.Future:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = hook(hook_state, bucket)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            original.copy_(future_value(fut))
            return original

        return fut.then(decompress)

    wrapper_hook.__name__ = wrapper_hook.__qualname__ = name
    return wrapper_hook


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run `hook` on a float16 copy of the bucket and cast its result back
    (`fp16_compress_wrapper(allreduce_hook)` is `fp16_compress_hook`)."""
    return _compress_wrapper(torch.float16, hook, "fp16_compress_wrapper_hook")


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run `hook` on a bfloat16 copy of the bucket and cast its result back."""
    return _compress_wrapper(torch.bfloat16, hook, "bf16_compress_wrapper_hook")


__all__ = [
    "allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
    "fp16_compress_wrapper",
]
