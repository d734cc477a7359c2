"""DistributedDataParallel: torch's wrapper by name, arguments, defaults and meaning.

    DDP(module)  -> ReplicaState: shapes checked, params + buffers from rank 0, buckets
    ddp(x)       -> pre_forward -> module(x) -> post_forward (outputs watched)
    loss.backward() -> buckets all-reduced as they fill -> averaged .grads at the end

The wrapped module is `ddp.module` (state-dict keys gain the "module." prefix, as in
torch); `plait.ddp.replicate` is the composable form that keeps the module's own names.
Plait extras: `device_mesh=` (1-D) in place of `process_group`, and `ddp.reducer`, whose
`buckets` show what is reduced together.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.distributed import ProcessGroup

from plait import comm
from plait.ddp.compiled import not_traced
from plait.ddp.join import Join, JoinHook, _JoinConfig
from plait.ddp.reducer import Reducer
from plait.ddp.replica import ReplicaState, bucket_caps


def resolve_group(process_group: ProcessGroup | None, device_mesh: Any) -> ProcessGroup:
    """The group to reduce over: `process_group`, a 1-D mesh's group, or the world."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(f"data parallel takes a 1-D device mesh, got {device_mesh.ndim}-D {device_mesh}; "
                             "slice the data-parallel axis, e.g. mesh['dp']")
        return device_mesh.get_group()
    return process_group if process_group is not None else comm.world_group()


class DistributedDataParallel(nn.Module):
    """Replicate `module` on every rank of the group and average gradients in backward.

    Each rank feeds its own slice of the data; after `loss.backward()` every replica holds
    the gradient of the mean loss over all ranks' data, so they stay equal step by step.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        device_mesh: Any = None,
        bucket_cap_mb_list: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        if check_reduction:
            warnings.warn("check_reduction is deprecated (as in torch) and has no effect", FutureWarning, stacklevel=2)
        group = resolve_group(process_group, device_mesh)
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", None) or ())
        self.module = module
        self.dim = dim
        self.output_device = output_device
        self.device_mesh = device_mesh
        self.process_group = group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        caps = bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self.bucket_bytes_cap = caps[-1]
        self._state = ReplicaState(
            module, group=group, ignored=ignored, broadcast_buffers=broadcast_buffers, init_sync=init_sync,
            caps=caps, find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph, device_ids=device_ids,
        )
        self.device = self._state.device
        self.device_ids = self._state.device_ids

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Sequence[str]) -> None:
        """torch's way to keep parameters and buffers (by fqn) out of DDP: neither
        synchronized at start-up nor reduced. Call before wrapping."""
        module._ddp_params_and_buffers_to_ignore = list(params_and_buffers_to_ignore)

    # Not traced by dynamo (its callees are): under torch.compile the module is compiled in
    # bucket-sized pieces so that all-reduces overlap the compiled backward (ddp/compiled.py).
    @not_traced
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        callback = get_eval_frame_callback()  # a C call: no frame for dynamo to trace
        module, state = self.module, self._state  # nn.Module.__getattr__ is a frame: once
        inputs, kwargs = state.pre_forward(module, inputs, kwargs)
        run = state.compile.compiled_for(module, callback) if callback else None
        if run is None:
            run = module
        return state.post_forward(module, inputs, run(*inputs, **kwargs))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients locally; the first
        synced backward after the block reduces the sum."""
        old = self._state.require_backward_grad_sync
        self._state.require_backward_grad_sync = False
        try:
            yield
        finally:
            self._state.require_backward_grad_sync = old

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._state.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._state.require_backward_grad_sync = value

    @property
    def require_forward_param_sync(self) -> bool:
        return self._state.require_forward_param_sync

    @property
    def broadcast_buffers(self) -> bool:
        return self._state.broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._state.broadcast_buffers = value

    @property
    def reducer(self) -> Reducer:
        return self._state.reducer

    def will_sync_module_buffers(self) -> bool:
        return self._state.will_sync_module_buffers()

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future[Tensor]` instead of the
        default averaging all-reduce. The bucket's buffer is *not* pre-divided by the world
        size. Register once, before the first backward."""
        self._state.register_comm_hook(state, hook)

    # -- uneven inputs ----------------------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """`with ddp.join(): ...` lets ranks run different numbers of iterations. Joined
        ranks contribute zero gradients; with `divide_by_initial_world_size` (torch's
        default) the sum is divided by the whole group's size, else by the number of ranks
        still training."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self._state.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self._state.join_device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self._state.join_process_group

    @property
    def _join_config(self) -> _JoinConfig:
        return self._state._join_config

    @_join_config.setter
    def _join_config(self, config: _JoinConfig) -> None:
        self._state._join_config = config
