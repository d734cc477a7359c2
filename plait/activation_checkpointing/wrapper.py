"""The wrapper API of activation checkpointing: torch's checkpoint_wrapper
(torch.distributed.algorithms._checkpoint.checkpoint_wrapper), on torch.utils.checkpoint.

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        each Block -> CheckpointWrapper(Block): forward runs under torch.utils.checkpoint,
        so autograd keeps only the block's inputs; backward re-runs the block's forward to
        rebuild what it needs, then differentiates it

Invariant: a wrapper changes what autograd saves, never the numbers or the names. Its
child sits at `_checkpoint_wrapped_module`, but named_parameters(), state_dict() and
load_state_dict() drop and restore that prefix, so a checkpointed model saves and loads
the same keys as the plain one (and the optimizer's parameter names do not change).

Order with the other strategies (docs/DESIGN.md): tensor parallel, then activation
checkpointing, then compile, then FSDP. fully_shard on a CheckpointWrapper gathers before
the recompute too: the recompute runs inside the wrapper's backward, when its group is
unsharded already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import Enum, auto
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint as torch_utils_checkpoint

_CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
_CHECKPOINT_PREFIX = _CHECKPOINT_WRAPPED_MODULE + "."


class CheckpointImpl(Enum):
    REENTRANT = auto()
    NO_REENTRANT = auto()


class ActivationWrapper(nn.Module):
    """Holds `mod` under `_checkpoint_wrapped_module`; hides that name from parameter and
    state-dict names. Subclasses define how forward runs it."""

    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = mod
        self._register_state_dict_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward; use CheckpointWrapper "
                                  "(checkpoint_wrapper) or OffloadWrapper (offload_wrapper)")

    def __getattr__(self, name: str) -> Any:
        """The wrapped module's attributes (model.blocks[0].attn works through the wrapper)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_checkpoint_wrapped_module":  # not set yet (or a copy being built): do not recurse
                raise
            return getattr(self._checkpoint_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:  # a wrapped nn.Sequential still indexes
        return self._checkpoint_wrapped_module.__getitem__(key)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameter names, without `_checkpoint_wrapped_module.`."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield name.replace(_CHECKPOINT_PREFIX, ""), param


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> dict[str, Any]:
    """state_dict post-hook: `{prefix}_checkpoint_wrapped_module.x` -> `{prefix}x`."""
    replace_prefix(state_dict, prefix + _CHECKPOINT_PREFIX, prefix)
    return state_dict


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: `{prefix}x` -> `{prefix}_checkpoint_wrapped_module.x`, so a
    plain model's state dict loads into the checkpointed one."""
    replace_prefix(state_dict, prefix, prefix + _CHECKPOINT_PREFIX)


def replace_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Rename keys starting with `old` in place, keeping the dict's order; a key that already
    starts with `new` (a state dict saved with the wrapper's names) is left as it is."""
    if old == new:
        return
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        if key.startswith(old) and not (new.startswith(old) and key.startswith(new)):
            key = new + key[len(old):]
        state_dict[key] = value


class CheckpointWrapper(ActivationWrapper):
    """Runs the wrapped module under torch.utils.checkpoint (made by checkpoint_wrapper)."""

    def __init__(self, mod: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                 checkpoint_fn: Callable | None = None, **checkpoint_fn_kwargs: Any) -> None:
        super().__init__(mod)
        if not isinstance(checkpoint_impl, CheckpointImpl):
            raise TypeError(f"checkpoint_impl must be a CheckpointImpl (REENTRANT or NO_REENTRANT), got "
                            f"{checkpoint_impl!r}")
        self.checkpoint_impl = checkpoint_impl
        if checkpoint_fn is None:
            checkpoint_fn = partial(torch_utils_checkpoint,
                                    use_reentrant=checkpoint_impl is CheckpointImpl.REENTRANT)
        self.checkpoint_fn = partial(checkpoint_fn, **checkpoint_fn_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._checkpoint_wrapped_module
        if self.checkpoint_impl is CheckpointImpl.REENTRANT and kwargs:
            # the reentrant checkpoint passes only positional tensors through its Function:
            # flatten the keyword arguments into positions and rebuild them inside
            keys = tuple(kwargs)
            flat = (*args, *kwargs.values())

            def run(*inputs: Any) -> Any:
                n = len(inputs) - len(keys)
                return inner(*inputs[:n], **dict(zip(keys, inputs[n:])))

            return self.checkpoint_fn(run, *flat)
        return self.checkpoint_fn(inner, *args, **kwargs)


class OffloadWrapper(ActivationWrapper):
    """Runs the wrapped module with the tensors autograd saves moved to (pinned) CPU memory."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=torch.accelerator.is_available()):
            return self._checkpoint_wrapped_module(*args, **kwargs)


def checkpoint_wrapper(module: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                       checkpoint_fn: Callable | None = None, **checkpoint_fn_kwargs: Any) -> nn.Module:
    """`module`, recomputed in backward instead of keeping its activations.
    `checkpoint_fn` replaces torch.utils.checkpoint.checkpoint (then `checkpoint_impl` is
    not used); `checkpoint_fn_kwargs` go to it (e.g. preserve_rng_state=False)."""
    if isinstance(module, ActivationWrapper):
        raise ValueError(f"{type(module._checkpoint_wrapped_module).__name__} is wrapped in a "
                         f"{type(module).__name__} already; wrap a module once")
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def offload_wrapper(module: nn.Module) -> nn.Module:
    """`module`, with the activations autograd saves kept on the CPU."""
    return OffloadWrapper(module)


def apply_activation_checkpointing(model: nn.Module, checkpoint_wrapper_fn: Callable = checkpoint_wrapper,
                                   check_fn: Callable[[nn.Module], bool] = lambda _: True,
                                   auto_wrap_policy: Callable | None = None) -> None:
    """Wrap, in place, every submodule of `model` that `check_fn` accepts (or that
    `auto_wrap_policy`, which takes precedence, selects) with `checkpoint_wrapper_fn`.
    `model` itself is never wrapped; a selected module inside a selected module is wrapped
    too (children first). A module already in an ActivationWrapper is left as it is, so a
    second call does not checkpoint it twice."""
    from plait.fsdp.wrap import apply_wrap, lambda_auto_wrap_policy, wrap_targets

    policy = auto_wrap_policy if auto_wrap_policy is not None else partial(lambda_auto_wrap_policy,
                                                                           lambda_fn=check_fn)
    inside = {id(w._checkpoint_wrapped_module) for w in model.modules() if isinstance(w, ActivationWrapper)}
    targets = [(m, {}) for m, _ in wrap_targets(model, policy)
               if not isinstance(m, ActivationWrapper) and id(m) not in inside]
    apply_wrap(model, targets, checkpoint_wrapper_fn)


__all__ = [
    "ActivationWrapper", "CheckpointImpl", "CheckpointWrapper", "OffloadWrapper",
    "apply_activation_checkpointing", "checkpoint_wrapper", "offload_wrapper",
]
