"""Stages that compose: a stage whose submodule is data parallel reduces its grads once a step.

    step starts        GradSync.begin_step(): the submodule's own per-backward sync is off
                       (DDP / replicate: require_backward_grad_sync = False), so each B or W
                       only accumulates into .grad; nothing is sent per microbatch
    stage's m-th B|W   GradSync.last_backward(): the accumulated grads of this stage, flat per
                       dtype, one async all-reduce (sum) over the data-parallel group, launched
                       while the pipeline goes on with its other stage or its sends
    step ends          GradSync.end_step(): wait, grads /= dp size, the submodule's flag
                       restored; then the schedule's scale_grads (/= m) runs on the averaged
                       grads, as torch's does after its REDUCE_GRAD

Why not let DDP's reducer fire in the last backward (torch's `prepare_for_backward` trick):
the split backward (I then W) computes weight grads with `autograd.grad` and writes `.grad`
itself, so the hooks DDP relies on never see them. Reducing the finished `.grad`s once is
exact for B and I/W alike, and it is one collective per stage per step.

Adapters. `grad_sync_for(module)` asks each registered adapter in turn; plait's DDP wrapper and
`replicate` are known here. A stage whose parameters are DTensors (tensor parallel) needs no
adapter: its grads are complete DTensors, and `scale_grads` divides them in place like any
tensor. `fully_shard` (plait.fsdp) has its own adapter in fully_sharded.py: one all-gather
and one reduce-scatter per group per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup

from plait import comm


class GradSync(Protocol):
    """What a stage does around one step when its submodule reduces grads across replicas."""

    def begin_step(self) -> None: ...

    def after_backward(self) -> None:
        """After each B or W of this stage (the microbatch's weight grads are in .grad)."""

    def last_backward(self) -> None: ...

    def end_step(self) -> None: ...


_ADAPTERS: list[Callable[[nn.Module], GradSync | None]] = []


def register_grad_sync(adapter: Callable[[nn.Module], GradSync | None]) -> None:
    """Teach stages a data-parallel kind: `adapter(module)` returns its GradSync or None."""
    _ADAPTERS.insert(0, adapter)


def grad_sync_for(module: nn.Module) -> GradSync | None:
    """The GradSync for a stage's submodule, or None if it reduces nothing across replicas."""
    for adapter in _ADAPTERS:
        found = adapter(module)
        if found is not None:
            return found
    return None


class ReplicaGradSync:
    """plait's DistributedDataParallel or `replicate`: average the stage's grads over `group`."""

    def __init__(self, state, what: str) -> None:
        reducer = state.reducer
        if reducer._hook is not None:
            raise ValueError(
                f"{what} has a DDP comm hook registered; a pipeline stage reduces its grads "
                "once per step without it (the hook would be skipped): remove the hook"
            )
        self.state = state
        self.group: ProcessGroup = reducer.group
        self.params = list(reducer.params)
        self.world = comm.get_world_size(self.group)
        self._saved: bool | None = None
        self._work: list[tuple[comm.Handle, torch.Tensor, list[torch.nn.Parameter]]] = []

    def begin_step(self) -> None:
        assert self._saved is None and not self._work, "begin_step twice without end_step"
        self._saved = self.state.require_backward_grad_sync
        self.state.require_backward_grad_sync = False

    def after_backward(self) -> None:
        pass  # .grad accumulates in the param's dtype, as DDP's no_sync does

    def last_backward(self) -> None:
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.params:  # every replica has the same params in the same order
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for params in by_dtype.values():
            # A param without a grad this step (unused) counts as zeros on this replica, so
            # every replica sends the same buffer shape and none waits for another.
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
            flat = _flatten_dense_tensors(grads)  # (sum of numels,)
            handle = comm.all_reduce(flat, group=self.group, op="sum", async_op=True)
            self._work.append((handle, flat, params))

    def end_step(self) -> None:
        for handle, flat, params in self._work:
            handle.wait()
            flat.div_(self.world)
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
            with torch.no_grad():
                for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
                    if p.grad is not None:
                        _local(p.grad).copy_(g)
                    elif g.any():  # used on another replica: the average of its grad and 0s
                        p.grad = _like(p, g.clone())
        self._work = []
        if self._saved is not None:
            self.state.require_backward_grad_sync = self._saved
        self._saved = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A TP DTensor's own shard (replicas of one tp rank hold the same placements, so averaging
    local shards over the data-parallel group is averaging the DTensors); a plain tensor as is.
    Flattening the DTensors themselves would gather them to full tensors first (wrong sizes)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a grad for `p`: a DTensor on p's mesh and placements when p is one."""
    if not hasattr(p, "to_local"):
        return local
    from plait.tensor import DTensor  # a layer above the pipeline runtime; imported late

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _plait_ddp(module: nn.Module) -> GradSync | None:
    from plait.ddp import DistributedDataParallel  # a layer below; imported late: optional

    if isinstance(module, DistributedDataParallel):
        return ReplicaGradSync(module._state, type(module).__name__)
    state = module.__dict__.get("_replicate_state")
    if state is not None:
        return ReplicaGradSync(state, f"replicate({type(module).__name__})")
    return None


register_grad_sync(_plait_ddp)

from . import fully_sharded  # noqa: E402, F401  (registers the fully_shard adapter)
