"""FSDPModule: the methods `fully_shard` mixes into a module's class (torch's names).

    unshard()/reshard()                    move the group between SHARDED and UNSHARDED by hand
    set_requires_gradient_sync(False)      gradient accumulation: keep unsharded grads, no reduce
    set_reshard_after_forward/backward     trade memory for all-gathers
    set_modules_to_forward/backward_prefetch   explicit prefetch lists instead of the default
    set_is_last_backward / set_requires_all_reduce   micro-batching and HSDP knobs
    set_gradient_divide_factor(1.0)        sum the gradients instead of averaging them

Setters take `recurse=True` as torch's do: they apply to every FSDP group in the subtree.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from plait.fsdp.state import FSDPState


class UnshardHandle:
    """What unshard(async_op=True) returns: wait() finishes the all-gather and exposes the
    unsharded parameters."""

    def __init__(self, state: FSDPState | None) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state is not None and self._state.group is not None:
            self._state.group.wait_for_unshard()
            self._state._note_peak()
        self._state = None


class FSDPModule:
    """Mixed in first: `isinstance(model, FSDPModule)` and `isinstance(model, MyModel)` both hold."""

    _plait_fsdp_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any):
        # constructing FSDP<Class>(...) directly builds the plain class, as torch's does
        orig = cls.__mro__[2]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError("FSDP does not support deepcopy; deepcopy the module before fully_shard")

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        from plait.fsdp.fully_shard import _states

        return list(_states(self, recurse))  # type: ignore[arg-type]

    def _groups(self, recurse: bool):
        return [s.group for s in self._fsdp_states(recurse) if s.group is not None]

    def reshard(self) -> None:
        """Free this group's unsharded parameters; the sharded DTensors are registered again."""
        state = self._plait_fsdp_state
        if state.group is not None:
            state.group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this group's parameters; with async_op a handle whose wait() finishes it."""
        state = self._plait_fsdp_state
        state.lazy_init()  # a no-op once the root is known
        if state.group is not None:
            state.group.unshard(async_op=True)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients without reducing them (the last
        micro-step sets True and reduces the sum)."""
        for g in self._groups(recurse):
            g.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters on the shard axis but defers the replicate all-reduce."""
        for g in self._groups(recurse):
            g.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for s in self._fsdp_states(recurse):
            s.auto_reshard_after_forward = False
            if s.group is not None:
                s.group.reshard_after_forward = reshard_after_forward
                if s.group.post_forward_size is not None:  # a bool means: reshard fully, or not at all
                    if s.group.state.name == "SHARDED_POST_FORWARD":
                        s.group.reshard()
                    s.group.post_forward_size = s.group.post_forward_group = None

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of the data-parallel size (1.0: a
        plain sum, for a loss already divided by the global token count). This module's group
        only, as torch's (torchtitan calls it on every FSDPModule)."""
        if not factor > 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        for g in self._groups(recurse=False):
            g.gradient_divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """torch: reduce with SUM only, dividing in a separate step (NCCL's zero-copy path, Gloo's
        lack of PREMUL_SUM). plait's reductions already are SUM then a division, so this
        records the choice on this module's group; the gradients are the same."""
        for g in self._groups(recurse=False):
            g.force_sum_reduction_for_comms = bool(enable)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for g in self._groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) right after this one's, in forward."""
        self._plait_fsdp_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) right after this one's, in backward."""
        self._plait_fsdp_state.backward_prefetch = [_state_of(m) for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of this backward does not wait for the reduce-scatters in flight
        (the next forward does)."""
        self._plait_fsdp_state.ctx.is_last_backward = is_last_backward


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run fully_shard's forward hooks around `module.<method_name>` too (e.g. `generate`),
    which nn.Module's hooks only do for `forward`."""
    state = _state_of(module)
    method = getattr(module, method_name)
    post_forward = state._make_post_forward(module)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        return post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def _state_of(module: nn.Module) -> FSDPState:
    state = getattr(module, "_plait_fsdp_state", None)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not an FSDPModule; call fully_shard on it first")
    return state


__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]
