"""FSDPState: the hooks that drive one group through a training step, and the root's
bookkeeping for all of them.

    forward pre-hook   (root: lazy init, cast inputs) -> unshard + wait -> prefetch the next
                       group's all-gather (async) -> wrap inputs in RegisterPostBackward
    forward hook       reshard if reshard_after_forward -> record the post-forward order ->
                       a pre-backward hook on every output that requires grad (a group of
                       several modules: after the last of them; one the forward skipped is
                       completed by the root's forward hook, its pre-backward hook on the
                       root's output; a module of it called alone later, as a chunked loss
                       calls lm_head, gathers and registers its post-backward as any call)
    pre-backward       (first output grad to arrive) unshard + wait -> prefetch the group
                       that runs backward next (the one before in post-forward order)
    post-backward      (when the module's input grads are computed: its parameter grads are
                       final) reshard if reshard_after_backward -> queue the reduce-scatter
    root final callback (autograd engine, end of backward) post-backward for groups whose
                       inputs needed no grad -> wait for every reduce-scatter -> reset

The root is the first state to run forward; it owns the context every state shares (all
states, forward orders, the reduce-scatter queue). Hooks run outside torch.compile.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from plait.fsdp.api import MixedPrecisionPolicy
from plait.fsdp.group import ParamGroup, ShardedState
from plait.fsdp.reduce import ReduceQueue

_dynamo_disable = torch._disable_dynamo


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class SharedContext:
    """What the root's states share for one model."""

    def __init__(self) -> None:
        self.states: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []  # pre-forward order, this iteration
        self.last_forward_order: list[FSDPState] = []  # the previous iteration's (forward prefetch)
        self.post_forward_order: list[FSDPState] = []  # backward runs it in reverse
        self.queue = ReduceQueue()
        self.callback_queued = False
        self.finishing = False  # the root's final callback is running
        self.is_last_backward = True
        # most non-root groups unsharded (or being gathered) at once; the root's group is
        # unsharded for the whole of its forward, around every other group's (tests read it)
        self.peak_unsharded = 0
        self.peak_unsharded_bytes = 0  # flat unsharded buffers alive at once, root included


class FSDPState:
    def __init__(self, modules: list[nn.Module], group: ParamGroup | None, *, mp_policy: MixedPrecisionPolicy,
                 auto_reshard_after_forward: bool, name: str) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.name = name
        self.is_root: bool | None = None
        self.ctx = SharedContext()
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None  # explicit lists override the default
        self.backward_prefetch: list[FSDPState] | None = None
        # FullyShardedDataParallel's BACKWARD_POST: prefetch once this group's gradients are
        # reduced (its unsharded memory freed) rather than when its backward begins
        self.prefetch_after_backward = False
        self.backward_end_hooks: list = []  # run by the root at the end of the last backward
        self._to_run: set[nn.Module] = set()  # modules of the group yet to finish this forward
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._make_post_forward(module), always_call=True))

    # -- root --------------------------------------------------------------------------------

    def lazy_init(self) -> None:
        """The first state to run (forward or unshard()) becomes the root of its subtree."""
        if self.is_root is not None:
            return
        if len(self.modules) != 1:
            raise RuntimeError(f"the root of fully_shard must be one module, but {self.name} is a list "
                               "of modules; call fully_shard on their common parent too")
        self.is_root = True
        root = self.modules[0]
        ctx = self.ctx
        for module_name, module in root.named_modules():
            state = getattr(module, "_plait_fsdp_state", None)
            if state is None or state in ctx.states:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(f"fully_shard state of {module_name!r} was initialised before its root "
                                       f"{self.name}: run forward through the root module first")
                state.is_root = False
                state.ctx = ctx
            ctx.states.append(state)
            if state.group is not None:
                state.group.queue = ctx.queue
        if self.auto_reshard_after_forward and self.group is not None:
            # the root's parameters are needed again first thing in backward
            self.group.reshard_after_forward = False
        fsdp_of = {id(p.sharded): p for s in ctx.states if s.group for p in s.group.params}
        for fqn, param in root.named_parameters(remove_duplicate=False):
            if id(param) in fsdp_of:
                fsdp_of[id(param)].fqn = fqn

    def _note_peak(self) -> None:
        """Update the peaks of unsharded groups and bytes (one pass: it runs at every unshard)."""
        ctx = self.ctx
        groups = live = 0
        for s in ctx.states:
            g = s.group
            if g is not None and (g.state is ShardedState.UNSHARDED or g._gather is not None):
                live += g.world * g.total * g.param_dtype.itemsize  # g.unsharded_bytes, inline
                groups += not s.is_root
        ctx.peak_unsharded = max(ctx.peak_unsharded, groups)
        ctx.peak_unsharded_bytes = max(ctx.peak_unsharded_bytes, live)

    def unshard(self) -> None:
        if self.group is not None:
            self.group.unshard()
            self._note_peak()

    def prefetch(self, targets: list[FSDPState]) -> None:
        for state in targets:
            if state.group is not None and not state.group.is_unsharded:
                state.group.unshard(async_op=True)
        self._note_peak()

    # -- forward -----------------------------------------------------------------------------

    @_dynamo_disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD:  # activation-checkpoint recompute
            self.unshard()
            return self._cast_inputs(args, kwargs)
        self.lazy_init()
        ctx = self.ctx
        first = self.training_state is not TrainingState.FORWARD
        if first:
            self.training_state = TrainingState.FORWARD
            self._to_run = set(self.modules)
            if self.is_root:
                ctx.queue.drain()  # a backward that was not the last left reductions in flight
                ctx.forward_order, ctx.post_forward_order = [], []
        args, kwargs = self._cast_inputs(args, kwargs)
        self.unshard()
        if first:
            ctx.forward_order.append(self)
            self.prefetch(self.forward_prefetch if self.forward_prefetch is not None else
                          _after(ctx.last_forward_order, self))
        if torch.is_grad_enabled():
            args, kwargs = _register_post_backward(self, args, kwargs)
        return args, kwargs

    def _make_post_forward(self, module: nn.Module):
        @_dynamo_disable
        def post_forward(mod: nn.Module, inputs: Any, output: Any) -> Any:
            if self.training_state is TrainingState.PRE_BACKWARD:
                return self._cast_output(output)
            self._to_run.discard(module)
            if self._to_run:
                return self._cast_output(output)
            if self.group is not None and self.group.reshard_after_forward:
                self.group.reshard_after_forward_pass()
            self.ctx.post_forward_order.append(self)
            self.training_state = TrainingState.IDLE
            output = self._register_pre_backward(output)
            if self.is_root:
                output = self._complete_skipped_groups(output)
                self._finish_root_forward()
            return self._cast_output(output)

        return post_forward

    def _complete_skipped_groups(self, output: Any) -> Any:
        """Finish the forward of every group of several modules that this forward left
        unfinished (torchtitan's chunked loss: fully_shard([norm, lm_head]), the model runs
        norm only and the loss calls lm_head per chunk later), as torch's
        _force_complete_incomplete_states: reshard, and gather again when the root output's
        gradient arrives, so the modules that did run have their parameters in backward."""
        for state in reversed(self.ctx.states):  # the deepest first, as their own hooks would
            if state is self or state.training_state is not TrainingState.FORWARD or not state._to_run:
                continue
            state._to_run.clear()
            if state.group is not None and state.group.reshard_after_forward:
                state.group.reshard_after_forward_pass()
            self.ctx.post_forward_order.append(state)
            state.training_state = TrainingState.IDLE
            output = state._cast_output(state._register_pre_backward(output))
        return output

    def _finish_root_forward(self) -> None:
        ctx = self.ctx
        ctx.last_forward_order = list(ctx.forward_order)
        for state in ctx.states:  # prefetched, but this forward did not run it
            if state.group is not None and state.group.gather_pending:
                state.group.reshard()

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.mp_policy.param_dtype
        if not (self.mp_policy.cast_forward_inputs and dtype):
            return args, kwargs
        return tree_map(lambda t: _cast(t, dtype), args), tree_map(lambda t: _cast(t, dtype), kwargs)

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else tree_map(lambda t: _cast(t, dtype), output)

    # -- backward ----------------------------------------------------------------------------

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):  # the common case, without pytree's calls
            if output.requires_grad:
                output.register_hook(self._pre_backward)
            return output
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward)
        return output

    @_dynamo_disable
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad  # an earlier output's hook did the work
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._root_final_callback)
        self.unshard()
        if not self.prefetch_after_backward:
            self._prefetch_backward()
        return grad

    def _prefetch_backward(self) -> None:
        if self.backward_prefetch is not None:
            self.prefetch(self.backward_prefetch)
        else:
            self.prefetch(_after(self.ctx.post_forward_order[::-1], self))

    def post_backward(self) -> None:
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        if self.group is not None:
            self.group.post_backward()
        if self.prefetch_after_backward and not self.ctx.finishing:
            self._prefetch_backward()  # (the final callback's post-backwards have none to prefetch)

    @_dynamo_disable
    def _root_final_callback(self) -> None:
        ctx = self.ctx
        ctx.finishing = True
        for state in reversed(ctx.states):
            if state.training_state is not TrainingState.POST_BACKWARD:
                state.post_backward()  # its inputs needed no grad: autograd never called it
            state.training_state = TrainingState.IDLE
        ctx.finishing = False
        if ctx.is_last_backward:
            ctx.queue.drain()
            for state in ctx.states:
                for hook in state.backward_end_hooks:
                    hook()
        ctx.callback_queued = False


def _after(order: list[FSDPState], state: FSDPState) -> list[FSDPState]:
    """The state that follows `state` in `order` (the default prefetch target)."""
    if state in order:
        i = order.index(state)
        if i + 1 < len(order):
            return [order[i + 1]]
    return []


def _cast(t: Any, dtype: torch.dtype) -> Any:
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


_SCALARS = (int, float, bool, str, complex)  # pytree leaves, like tensors and None


class RegisterPostBackward(torch.autograd.Function):
    """Identity in forward; in backward, once the grads of the module's inputs exist (so its
    parameter grads do too), the group's post-backward."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state.post_backward()
        return (None, *grads)


def _register_post_backward(state: FSDPState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if not kwargs:  # positional tensors and scalars only (a block's call): no pytree
        where, tensors = [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if a.requires_grad:
                    where.append(i)
                    tensors.append(a)
            elif not (a is None or type(a) in _SCALARS):
                break
        else:
            if not where:
                return args, kwargs
            outs = RegisterPostBackward.apply(state, *tensors)
            flat_args = list(args)
            for i, t in zip(where, outs):
                flat_args[i] = t
            return tuple(flat_args), kwargs
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return args, kwargs
    outs = RegisterPostBackward.apply(state, *(flat[i] for i in where))
    for i, t in zip(where, outs):
        flat[i] = t
    return tree_unflatten(flat, spec)


__all__ = ["FSDPState", "SharedContext", "TrainingState"]
