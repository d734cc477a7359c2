"""Composable activation checkpointing: `checkpoint(module)` (torch.distributed._composable.checkpoint).

    checkpoint(block)             forward pre-hook ──▶ enter torch's non-reentrant checkpoint
                                  forward hook     ──▶ leave it: autograd keeps only the block's inputs
    backward                      re-runs block.forward (hooks off) to rebuild what it needs

Invariant: the module is not wrapped and not renamed — its fqns, state dict and optimizer names
are the plain model's — and the numbers are the plain model's; only what autograd saves
changes. This is the hook-based twin of wrapper.py's `checkpoint_wrapper`; like
it, it goes before compile and FSDP in the order that composes (docs/DESIGN.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import (
    _DEFAULT_DETERMINISM_MODE,
    _checkpoint_without_reentrant_generator,
)


@dataclass
class _State:
    enable_hook: bool = True
    generator: Generator[None, None, None] | None = None


_STATES: weakref.WeakKeyDictionary[nn.Module, _State] = weakref.WeakKeyDictionary()


def _state(module: nn.Module) -> _State:
    return _STATES[module]


@contextmanager
def _hooks_off(module: nn.Module, user_ctx: AbstractContextManager | None = None):
    """The recompute calls module.forward again: its hooks must not start a second checkpoint."""
    with user_ctx if user_ctx is not None else nullcontext():
        state = _state(module)
        was, state.enable_hook = state.enable_hook, False
        try:
            yield
        finally:
            state.enable_hook = was


def checkpoint(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Checkpoint `module`'s activations through forward hooks; returns `module` itself (torch's).

    Keywords as torch: `preserve_rng_state=True`, `context_fn=None` (returns the forward and
    recompute contexts), `determinism_check`, `debug=False`, `early_stop=True`;
    `use_reentrant=True` is refused, as in torch.
    """
    if kwargs.pop("use_reentrant", False):
        raise NotImplementedError(
            "use_reentrant=True is not supported by the composable checkpoint(); "
            "use torch.utils.checkpoint.checkpoint or checkpoint_wrapper(CheckpointImpl.REENTRANT)"
        )
    preserve_rng_state = kwargs.pop("preserve_rng_state", True)
    user_context_fn: Callable | None = kwargs.pop("context_fn", None)
    determinism_check = kwargs.pop("determinism_check", _DEFAULT_DETERMINISM_MODE)
    debug = kwargs.pop("debug", False)
    early_stop = kwargs.pop("early_stop", True)
    if kwargs:
        raise ValueError(f"checkpoint({type(module).__name__}): unexpected keyword arguments {sorted(kwargs)}")
    if module in _STATES:
        raise ValueError(f"checkpoint() was already applied to this {type(module).__name__}; apply it once")

    def context_fns() -> tuple[AbstractContextManager, AbstractContextManager]:
        if user_context_fn is None:
            return nullcontext(), _hooks_off(module)
        forward_ctx, recompute_ctx = user_context_fn()
        return forward_ctx, _hooks_off(module, recompute_ctx)

    def pre_hook(mod: nn.Module, args: tuple, kw: dict) -> None:
        state = _state(mod)
        if state.enable_hook:
            state.generator = _checkpoint_without_reentrant_generator(
                mod, preserve_rng_state, context_fns, determinism_check, debug, early_stop, *args, **kw
            )
            next(state.generator)

    def post_hook(mod: nn.Module, inputs: tuple, output: Any) -> None:
        state = _state(mod)
        if state.enable_hook and state.generator is not None:
            try:
                next(state.generator)
            except StopIteration:
                pass
            else:
                raise AssertionError("the checkpoint generator outlived the forward it wraps")
        state.generator = None

    _STATES[module] = _State()
    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    # prepend + always_call: leave the checkpoint before any other forward hook runs, even on error
    module.register_forward_hook(post_hook, prepend=True, always_call=True)
    return module
