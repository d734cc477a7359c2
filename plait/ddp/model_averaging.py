"""Model averaging: replace every replica's parameters by their mean over a group.

    params (or an optimizer's param_groups) -> those with a .grad -> flat buffer (common dtype)
    -> / N -> all-reduce(sum) over the group -> copied back into each parameter, its dtype kept

`PeriodicModelAverager` does this every `period` steps once `warmup_steps` calls have passed:
with post-local SGD (plait.ddp.comm_hooks.post_localSGD_hook) it is the only moment the
replicas of different subgroups meet. Names and meaning follow torch's
`torch.distributed.algorithms.model_averaging.{averagers, utils}`.

Invariant: right after an averaging call every member of the group holds the same bits in
every averaged parameter (all receive the same all-reduced buffer). Unlike torch, which
re-points each `p.data` at a slice of the flat buffer, the mean is copied into the parameter's
own storage: views, optimizer state and DDP's references to it stay valid.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait import comm
from plait.ddp.shards import local

Params = Iterable[torch.nn.Parameter] | Iterable[dict]


def average_parameters(params: Iterator[torch.nn.Parameter], process_group: ProcessGroup | None) -> None:
    """Average `params` over `process_group` (None: the world), in place. One all-reduce of
    a flat buffer: extra memory the size of the parameters. A DTensor parameter averages its
    local shard (the group must be the replicas of that shard). A rank outside the group
    leaves its parameters alone."""
    group = process_group if process_group is not None else comm.world_group()
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    tensors = [local(p.data) for p in params]
    if not tensors:
        return  # nothing has a gradient yet (torch.cat of nothing would raise)
    # Mixed dtypes promote in the buffer and are cast back below, as in torch.
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat /= comm.get_world_size(group)
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()  # pending kernels on other streams wrote these params
    comm.all_reduce(flat, group=group, op="sum")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def get_params_to_average(params: Params) -> list[torch.nn.Parameter]:
    """The parameters that have a gradient, from `model.parameters()` or `optimizer.param_groups`."""
    chosen = []
    for item in params:
        if isinstance(item, torch.nn.Parameter):
            if item.grad is not None:
                chosen.append(item)
        elif isinstance(item, dict):
            chosen.extend(p for p in item["params"] if p.grad is not None)
        else:
            raise NotImplementedError(f"Parameter input of type {type(item)} is not supported; pass "
                                      "model.parameters() or optimizer.param_groups")
    return chosen


def average_parameters_or_parameter_groups(params: Params, process_group: ProcessGroup) -> None:
    """Average the parameters (those with a gradient) of a model or of an optimizer's groups."""
    average_parameters(iter(get_params_to_average(params)), process_group)


class ModelAverager(ABC):
    """Base of the averagers: `process_group` (None: the world) and a `step` counter."""

    def __init__(self, process_group: ProcessGroup | None = None) -> None:
        self.process_group = process_group if process_group is not None else comm.world_group()
        self.step = 0

    @abstractmethod
    def average_parameters(self, params: Params) -> None:
        raise NotImplementedError


class PeriodicModelAverager(ModelAverager):
    """Average parameters every `period` calls after `warmup_steps` calls.

    Call `average_parameters(model.parameters())` (or an optimizer's `param_groups`) once per
    training step, after the optimizer step: call k (from 0) averages when
    k >= warmup_steps and (k - warmup_steps) % period == 0. For post-local SGD, set
    `warmup_steps` to the hook's `start_localSGD_iter`.
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: ProcessGroup | None = None) -> None:
        super().__init__(process_group)
        if warmup_steps < 0:
            raise ValueError(f"Arg ``warmup_steps`` must be a non-negative number, got {warmup_steps}.")
        self.warmup_steps = warmup_steps
        if period < 1:
            raise ValueError(f"Arg ``period`` must be a positive value, got {period}.")
        if period == 1:
            warnings.warn(
                "When period is 1, no need to use model averaging because the communication cost "
                "of all-reducing parameters will be no less than the cost of all-reducing gradients "
                "by DistributedDataParallel in the backward pass. Therefore, only "
                "DistributedDataParallel should be used for this case.",
                stacklevel=2,
            )
        self.period = period

    def average_parameters(self, params: Params) -> None:
        """Average `params` (a model's parameters or an optimizer's param groups) if this
        call is due, then count it."""
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            average_parameters_or_parameter_groups(params, self.process_group)
        self.step += 1


__all__ = [
    "ModelAverager", "PeriodicModelAverager", "average_parameters",
    "average_parameters_or_parameter_groups", "get_params_to_average",
]
