"""DDP comm hooks that run ZeroRedundancyOptimizer's step inside DDP's backward (overlap_with_ddp=True).

    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    bucket k ready -> hook(state, bucket): the all-reduce is launched ->
      hook_with_zero_step:             at the last bucket, for every bucket in order: the owner waits
                                       its all-reduce and steps its slice; every rank broadcasts it
      hook_with_zero_step_interleaved: at bucket k, the same for bucket k - 1 (and at the last
                                       bucket for it too): bucket k's all-reduce and the rest of
                                       backward overlap bucket k - 1's step and broadcast
    the last bucket's hook waits for every broadcast: parameters are final when backward returns

The first two backward passes do not step (zero_overlap.py): the first runs on DDP's provisional
buckets, the second records the final ones, and the third's bucket 0 builds the partition. Under
static_graph=True the first three do not, as in torch (whose DDP rebuilds a static graph later).

Differences from torch, both extensions: torch refuses Gloo ("may meet hangs"); plait runs on it,
because every collective is issued from the autograd thread in an order that depends on nothing
but bucket indices (torch's interleaved hook issues broadcasts from all-reduce callbacks, which
on Gloo run on worker threads in completion order, a rank-dependent order). So the interleaved
hook steps one bucket late instead of in the all-reduce's callback. And DDP with
find_unused_parameters=True never rebuilds its buckets, so ZeRO would never step: plait raises.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from plait.ddp.buckets import GradBucket
from plait.ddp.comm_hooks.default_hooks import future_value
from plait.ddp.distributed import DistributedDataParallel
from plait.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

Hook = Callable[[Any, GradBucket], torch.futures.Future]

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]


def _check(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, shard_buckets: bool) -> None:
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(f"zero must be a plait ZeroRedundancyOptimizer, got {type(zero).__name__}")
    if zero._overlap is None:  # torch's message
        raise ValueError("ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this "
                         "hook properly")
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"ddp must be plait's DistributedDataParallel, got {type(ddp).__name__}")
    if ddp.reducer.find_unused_parameters:
        raise ValueError("ZeRO's overlap partitions DDP's final buckets, which DDP fixes by rebuilding them after "
                         "the first iteration; with find_unused_parameters=True it never rebuilds, so the "
                         "optimizer would never step: pass find_unused_parameters=False (or static_graph=True)")
    if zero._overlap.hooked:
        raise RuntimeError("a ddp_zero_hook was already built for this ZeroRedundancyOptimizer; one DDP "
                           "model drives one optimizer")
    zero._overlap.hooked = True
    zero._overlap.shard_buckets = shard_buckets


def _buckets_final(ddp_ref: weakref.ReferenceType) -> bool:
    """Whether DDP's buckets no longer change. torch's DDP rebuilds them after the first
    iteration, or the second under static_graph; plait's after the first in both cases, so
    under static_graph one more iteration waits, for torch's count of iterations without a step."""
    reducer = ddp_ref().reducer
    return reducer.has_rebuilt and (not reducer.static_graph or reducer.num_iterations >= 2)


def _step_and_broadcast(zero: ZeroRedundancyOptimizer, k: int, futures: dict[int, torch.futures.Future]) -> None:
    """Bucket k's owner steps its slice from the reduced gradients; every rank broadcasts it."""
    overlap = zero._overlap
    if zero.rank in overlap.ranks_per_bucket[k]:
        fut = futures[k]
        fut.wait()
        overlap.step_bucket(k, future_value(fut))
    overlap.broadcast_bucket(k)


def _seen(zero: ZeroRedundancyOptimizer, bucket: GradBucket) -> int:
    overlap = zero._overlap
    k = bucket.index()
    assert k == len(overlap.seen), f"bucket {k} after buckets {overlap.seen}: DDP launches them in order"
    overlap.seen.append(k)
    return k


def hook_with_zero_step(hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> Hook:
    """`hook`, then, once every bucket's all-reduce is launched, ZeRO's step bucket by bucket
    (each owner as soon as its all-reduce is done) with each slice's broadcast: the step overlaps
    the all-reduces still in flight. With `shard_buckets`, a bucket may be split over ranks."""
    _check(ddp, zero, shard_buckets)
    ddp_ref = weakref.ref(ddp)
    futures: dict[int, torch.futures.Future] = {}

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> torch.futures.Future:
        fut = hook(state, bucket)
        if not zero._overlap.setup(bucket, _buckets_final(ddp_ref)):
            return fut
        k = _seen(zero, bucket)
        futures[k] = fut
        if k == zero._overlap.num_buckets - 1:
            for j in range(zero._overlap.num_buckets):
                _step_and_broadcast(zero, j, futures)
            futures.clear()
            zero._overlap.finish_iteration()
        return fut

    return hook_with_zero_fn


def hook_with_zero_step_interleaved(hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False) -> Hook:
    """`hook`, with ZeRO's step of each bucket interleaved with backward: bucket k - 1's slice is
    stepped and broadcast once bucket k's all-reduce is launched (the last bucket's right after
    its own), so backward, all-reduces and broadcasts overlap."""
    _check(ddp, zero, shard_buckets)
    ddp_ref = weakref.ref(ddp)
    futures: dict[int, torch.futures.Future] = {}

    def hook_with_zero_interleaved_fn(state: Any, bucket: GradBucket) -> torch.futures.Future:
        fut = hook(state, bucket)
        if not zero._overlap.setup(bucket, _buckets_final(ddp_ref)):
            return fut
        k = _seen(zero, bucket)
        futures[k] = fut
        if k > 0:  # bucket k - 1's all-reduce ran while backward computed bucket k
            _step_and_broadcast(zero, k - 1, futures)
            futures.pop(k - 1)
        if k == zero._overlap.num_buckets - 1:
            _step_and_broadcast(zero, k, futures)
            futures.clear()
            zero._overlap.finish_iteration()
        return fut

    return hook_with_zero_interleaved_fn
