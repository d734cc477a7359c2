"""Post-local SGD as a DDP comm hook: global gradient averaging first, local after.

    iteration < start_localSGD_iter:  bucket / N -> all-reduce over process_group (global)
    iteration >= start_localSGD_iter: bucket / n -> all-reduce over subgroup (local)
                                      or nothing, with post_local_gradient_allreduce=False

The replicas then drift apart between subgroups; a model averager (plait.ddp.model_averaging)
run after each optimizer step pulls them back together every `period` steps. `state.iter`
counts iterations by the last bucket of each backward, as torch's does, and stops counting
once the local phase starts (it is only compared against `start_localSGD_iter`).

Defaults. `process_group=None` is the group DDP reduces over (`bucket.process_group`, the
world for a DDP over every rank; torch always takes the world, which is wrong for DDP on a
sub-group). `subgroup=None` is this rank's node: the ranks of the global group that share
its block of `LOCAL_WORLD_SIZE` consecutive global ranks (torch's `dist.new_subgroups()`,
which sizes the block by the CUDA device count). It is created on the first local
iteration, through `plait.comm.new_group`, so only its members take part.
"""

from __future__ import annotations

import logging
import os

import torch
from torch.distributed import ProcessGroup

from plait import comm
from plait.ddp.buckets import GradBucket
from plait.ddp.comm_hooks.default_hooks import allreduce_fut

logger = logging.getLogger(__name__)


class PostLocalSGDState:
    """State of `post_localSGD_hook`: all-reduce gradients over `process_group` for the first
    `start_localSGD_iter` iterations, over `subgroup` afterwards (or not at all when
    `post_local_gradient_allreduce` is False; both settings can converge faster)."""

    __slots__ = ["process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce", "iter"]

    def __init__(self, process_group: ProcessGroup | None, subgroup: ProcessGroup | None,
                 start_localSGD_iter: int, post_local_gradient_allreduce: bool = True) -> None:
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)
        self.process_group = process_group  # the global group
        self.subgroup = subgroup  # the local group
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0  # iterations of the training loop seen so far (until the local phase)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count an iteration when its last bucket is reduced."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)


def intra_node_subgroup(global_group: ProcessGroup) -> ProcessGroup:
    """This rank's node within `global_group`: the members whose global rank lies in this
    rank's block of LOCAL_WORLD_SIZE consecutive global ranks (the launcher numbers a node's
    ranks consecutively). Without LOCAL_WORLD_SIZE the block is the CUDA device count."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value:
        try:
            per_node = int(value)
        except ValueError:
            raise ValueError(f"environment variable LOCAL_WORLD_SIZE={value!r} is not an integer") from None
    elif torch.cuda.is_available():
        per_node = torch.cuda.device_count()
    else:
        raise ValueError(
            "PostLocalSGDState(subgroup=None) needs the ranks per node: LOCAL_WORLD_SIZE is not set "
            "and CUDA is not available; start the job with `plait run`, or pass subgroup= "
            "(e.g. plait.comm.new_group(ranks))"
        )
    if per_node <= 0:
        raise ValueError(f"ranks per node ({per_node}) must be positive")
    me = comm.global_rank()
    node = me // per_node
    members = [r for r in comm.group_info(global_group).ranks if r // per_node == node]
    return comm.new_group(members)


def post_localSGD_hook(state: PostLocalSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Run post-local SGD: average the bucket globally for the first `start_localSGD_iter`
    iterations, within `state.subgroup` afterwards (or leave it as it is when
    `post_local_gradient_allreduce` is False). Pair it with a model averager after the
    optimizer step, e.g. `PeriodicModelAverager(period, warmup_steps=start_localSGD_iter)`.

        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10)
        ddp_model.register_comm_hook(state, post_localSGD_hook)
    """
    global_group = state.process_group if state.process_group is not None else bucket.process_group
    buffer = bucket.buffer()  # flat, not yet divided

    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_fut(global_group, buffer)

    if not state.post_local_gradient_allreduce:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    # Every rank reaches its first local bucket in the same iteration, so the members of a
    # node create their group together here.
    if state.subgroup is None:
        state.subgroup = intra_node_subgroup(global_group)
    return allreduce_fut(state.subgroup, buffer)


__all__ = ["PostLocalSGDState", "post_localSGD_hook"]
