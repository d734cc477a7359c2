"""plait.fsdp.wrap — torch's auto-wrap policies (torch.distributed.fsdp.wrap), by name,
signature and semantics, and the one traversal that turns a policy into wrap targets.

    policy(module=m, recurse=True,  nonwrapped_numel=n) -> descend into m's children?
    policy(module=m, recurse=False, nonwrapped_numel=r) -> wrap m, r = its parameters not
                                                           already in a wrapped descendant?
    _Policy._run_policy(root, ignored_modules, root_kwargs) -> {module: kwargs}

`wrap_targets(root, policy)` answers both kinds with the modules to wrap, children before
parents (post-order), never the root: FullyShardedDataParallel wraps the root itself and
apply_activation_checkpointing leaves it alone, as torch's do. `apply_wrap` then replaces
each target on its parent with `wrap_fn(target, **kwargs)`. Selection is pure (nothing is
changed until every target is known), so a bad policy fails before any module moves.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

from torch import nn

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module (and descend into every one)."""
    return True


class _Policy(ABC):
    """A policy that names its targets all at once (torch's _Policy)."""

    @abstractmethod
    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        """Every module to wrap, with the keyword arguments to wrap it with."""


def _module_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                        module_classes: set[type[nn.Module]]) -> bool:
    return True if recurse else isinstance(module, tuple(module_classes))


class ModuleWrapPolicy(_Policy):
    """Wrap every instance of `module_classes` (nested ones too)."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = set(module_classes)
        self._module_classes_str = str(self._module_classes)

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        classes = tuple(self._module_classes)
        return {m: copy.copy(root_kwargs) for m in root_module.modules()
                if m not in ignored_modules and isinstance(m, classes)}

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return _module_wrap_policy(module, recurse, -1, self._module_classes)

    def __repr__(self) -> str:
        return f"{super().__repr__()}({self._module_classes_str})"


class CustomPolicy(_Policy):
    """`lambda_fn(module)` returns False (leave it), True (wrap it with the root's
    arguments) or a dict (wrap it with the root's arguments updated by the dict)."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        out: dict[nn.Module, dict[str, Any]] = {}
        for m in root_module.modules():
            if m in ignored_modules:
                continue
            res = self._lambda_fn(m)
            if not isinstance(res, (dict, bool)):
                raise ValueError(f"the lambda_fn of CustomPolicy must return False/True or a dict of keyword "
                                 f"arguments, but it returned {res!r} for {type(m).__name__}")
            if res:
                out[m] = {**root_kwargs, **(res if isinstance(res, dict) else {})}
        return out


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Descend everywhere; wrap the modules `lambda_fn` returns True for."""
    return True if recurse else lambda_fn(module)


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: set[type[nn.Module]]) -> bool:
    """Wrap every instance of `transformer_layer_cls` (the blocks); the root takes the rest."""
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def _wrap_module_cls_individually(module: nn.Module, module_classes: Sequence[type], recurse: bool,
                                  *args: Any, **kwargs: Any) -> bool:
    return True if recurse else isinstance(module, tuple(module_classes))


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[Callable]) -> bool:
    """True where any of `policies` is."""
    return any(p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for p in policies)


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Wrap a module once the parameters no wrapped descendant holds reach
    `min_num_params`; never descend into `force_leaf_modules`, never wrap
    `exclude_wrap_modules` (containers)."""
    leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None \
        else force_leaf_modules
    excluded = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None \
        else exclude_wrap_modules
    is_large = nonwrapped_numel >= min_num_params
    return is_large and not isinstance(module, tuple(leaves if recurse else excluded))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


# -- the traversal -----------------------------------------------------------------------------


def wrap_targets(root: nn.Module, policy: Callable | _Policy, *, ignored_modules: set[nn.Module] = frozenset(),
                 ignored_params: set[nn.Parameter] = frozenset(), root_kwargs: dict[str, Any] | None = None,
                 ) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The modules under `root` (never `root`) that `policy` wraps, children first, each with
    its keyword arguments (`root_kwargs` unless a CustomPolicy overrides them)."""
    root_kwargs = dict(root_kwargs or {})
    if isinstance(policy, _Policy):
        chosen = policy._run_policy(root, set(ignored_modules), root_kwargs)
        order = _post_order(root, set(ignored_modules))
        return [(m, chosen[m]) for m in order if m in chosen and m is not root]
    if not callable(policy):
        raise TypeError(f"auto_wrap_policy must be a callable (module, recurse, nonwrapped_numel) -> bool or a "
                        f"ModuleWrapPolicy/CustomPolicy, got {type(policy).__name__}")
    ignored_ids = {id(p) for p in ignored_params}
    out: list[tuple[nn.Module, dict[str, Any]]] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        """Mirror torch's _recursive_wrap: returns the numel that ends up wrapped."""
        numel = sum(p.numel() for p in module.parameters() if id(p) not in ignored_ids)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, False) for child in module.children() if child not in ignored_modules)
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            out.append((module, dict(root_kwargs)))
            return numel
        return wrapped

    visit(root, True)
    return out


def _post_order(root: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
    seen: set[int] = set()
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen and child not in ignored:
                visit(child)
        out.append(m)

    visit(root)
    return out


def apply_wrap(root: nn.Module, targets: list[tuple[nn.Module, dict[str, Any]]],
               wrap_fn: Callable[..., nn.Module]) -> None:
    """Replace every target in its parent's slot by `wrap_fn(target, **kwargs)`, children
    first, so a parent is wrapped around its already wrapped children."""
    kwargs_of = {id(m): kw for m, kw in targets}
    seen = {id(root)}

    def visit(module: nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            visit(child)
            if id(child) in kwargs_of:
                module._modules[name] = wrap_fn(child, **kwargs_of[id(child)])

    visit(root)


# -- enable_wrap / wrap (manual wrapping) ------------------------------------------------------


class _ConfigAutoWrap:
    in_autowrap_context: bool = False
    wrapper_cls: Callable | None = None
    kwargs: dict[str, Any] = {}  # noqa: RUF012 - class-level, as torch's: one context at a time


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Inside, `wrap(module)` wraps with `wrapper_cls(module, **wrapper_kwargs)`."""
    if _ConfigAutoWrap.in_autowrap_context:
        raise NotImplementedError("enable_wrap contexts do not nest; leave the outer one first")
    _ConfigAutoWrap.in_autowrap_context = True
    _ConfigAutoWrap.wrapper_cls, _ConfigAutoWrap.kwargs = wrapper_cls, dict(wrapper_kwargs)
    try:
        yield
    finally:
        _ConfigAutoWrap.in_autowrap_context = False
        _ConfigAutoWrap.wrapper_cls, _ConfigAutoWrap.kwargs = None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap `module` inside an enable_wrap context; outside one, return it unchanged."""
    if not _ConfigAutoWrap.in_autowrap_context:
        return module
    kwargs = {**_ConfigAutoWrap.kwargs, **wrap_overrides, **getattr(module, "_wrap_overrides", {})}
    return _ConfigAutoWrap.wrapper_cls(module, **kwargs)
