"""replicate: data parallel as a change to the module, not a wrapper around it.

    replicate(model)  -> ReplicaState (shapes checked, parameters from rank 0, buckets)
                      -> forward pre-hook: pre_forward; forward hook: post_forward (as
                         torch's replicate registers them: a user's hooks run before or after
                         them in the order registered)
                      -> model's class becomes Replicate<Cls>: adds
                         set_requires_gradient_sync, no_sync, register_comm_hook, join
    model(x)          -> exactly DistributedDataParallel's iteration
    model.state_dict() -> the module's own keys: nothing was wrapped

On an N-D mesh pass the 1-D data-parallel axis (`device_mesh=mesh["dp"]`). Unlike torch's
`replicate`, it syncs the parameters at once (not at the first forward). Buffers are never
synced, neither at start nor before a forward, as with torch's `replicate`, whose DDP wraps
the parameters only (a ParameterList: `broadcast_buffers` is accepted and does nothing
there); this also keeps a per-forward broadcast off its step. Parameters may be DTensors on
the other axes of the mesh (tensor parallel inside data parallel): their local shards are
synced and reduced over dp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.distributed import ProcessGroup

from plait.ddp.compiled import not_traced
from plait.ddp.distributed import resolve_group
from plait.ddp.join import Join, JoinHook, _JoinConfig
from plait.ddp.replica import ReplicaState, bucket_caps

_STATE = "_replicate_state"


class _Replicated:
    """Methods a replicated module gains (first in its new class's MRO)."""

    # Not traced by dynamo: under torch.compile the module's own forward is compiled in
    # bucket-sized pieces so that all-reduces overlap the compiled backward (ddp/compiled.py).
    @not_traced
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        callback = get_eval_frame_callback()  # a C call: no frame for dynamo to trace
        state = self.__dict__[_STATE]
        run = state.compile.compiled_for(state.forward, callback) if callback else None
        if run is None:
            run = state.forward
        return run(*args, **kwargs)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: the following backward passes accumulate gradients without communication."""
        getattr(self, _STATE).require_backward_grad_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        state = getattr(self, _STATE)
        old = state.require_backward_grad_sync
        state.require_backward_grad_sync = False
        try:
            yield
        finally:
            state.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        getattr(self, _STATE).register_comm_hook(state, hook)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return getattr(self, _STATE).join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return getattr(self, _STATE).join_device

    @property
    def join_process_group(self) -> ProcessGroup:
        return getattr(self, _STATE).join_process_group

    @property
    def _join_config(self) -> _JoinConfig:
        return getattr(self, _STATE)._join_config

    @_join_config.setter
    def _join_config(self, config: _JoinConfig) -> None:
        getattr(self, _STATE)._join_config = config


def replicate(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None = None,
    *,
    device_mesh: Any = None,
    process_group: ProcessGroup | None = None,
    broadcast_buffers: bool = True,  # noqa: ARG001 - torch's keyword, no effect there either (see above)
    init_sync: bool = True,
    bucket_cap_mb: float | None = None,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    device_id: int | torch.device | None = None,
) -> nn.Module:
    """Make `module` data parallel in place and return it.

    Parameters of `ignored_modules` (and their submodules) are neither synchronized nor
    reduced. Options mean what they mean for DistributedDataParallel, except
    broadcast_buffers: buffers are left alone, as torch's replicate leaves them.
    """
    if hasattr(module, _STATE):
        raise RuntimeError(f"{type(module).__name__} is already replicated")
    group = resolve_group(process_group, device_mesh)
    ignored: set[str] = set()
    skip = {id(m) for root in (ignored_modules or ()) for m in root.modules()}
    for mod_name, mod in module.named_modules():
        if id(mod) in skip:
            prefix = f"{mod_name}." if mod_name else ""
            ignored |= {prefix + n for n, _ in mod.named_parameters(recurse=False)}
            ignored |= {prefix + n for n, _ in mod.named_buffers(recurse=False)}
    device_ids = None
    if device_id is not None and torch.device(device_id).type != "cpu":
        device_ids = [device_id]
    state = ReplicaState(
        module, group=group, ignored=ignored, broadcast_buffers=False, init_sync=init_sync,
        caps=bucket_caps(bucket_cap_mb, None), find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph, device_ids=device_ids,
    )
    module.__dict__[_STATE] = state  # not a submodule or parameter: the state dict is unchanged
    state.forward = module.forward  # its own forward (an instance override included), before the class changes
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    cls = type(module)
    module.__class__ = type(f"Replicate{cls.__name__}", (_Replicated, cls), {})
    return module


def replicate_state(module: nn.Module) -> ReplicaState:
    """The data-parallel state `replicate` attached to `module` (its reducer, flags)."""
    state = module.__dict__.get(_STATE)
    if state is None:
        raise ValueError(f"{type(module).__name__} was not replicated")
    return state
