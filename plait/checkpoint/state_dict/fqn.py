"""Canonical FQNs: a parameter's dotted name in the model a user wrote, whatever wraps it.

    DistributedDataParallel(m)   "module.layer.weight"                      -> "layer.weight"
    torch.compile(m)             "_orig_mod.layer.weight"                   -> "layer.weight"
    checkpoint_wrapper(block)    "block._checkpoint_wrapped_module.weight"  -> "block.weight"
    FullyShardedDataParallel(m)  "_fsdp_wrapped_module.layer.weight"        -> "layer.weight"

`replicate`, `fully_shard`, tensor parallel and pipeline-split stages keep the module's own
names, so they need nothing. Invariant: two layouts of one model give the same canonical keys,
so a state dict saved from one loads into the other; optimizer state is keyed by the same FQNs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# (wrapper class name, attribute holding the wrapped module): a path step through it is dropped
_WRAPPED_ATTRS = {
    "DistributedDataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
}
_ALWAYS_DROPPED = {"_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def _is_wrapper_step(obj: object, attr: str) -> bool:
    if attr in _ALWAYS_DROPPED:
        return True
    for cls in type(obj).__mro__:
        if _WRAPPED_ATTRS.get(cls.__name__) == attr and cls.__module__.split(".")[0] in ("plait", "torch"):
            return True
    return False


def canonical_fqn(model: nn.Module, name: str) -> str:
    """`name` (a key of model.state_dict() or named_parameters()) without wrapper steps."""
    kept: list[str] = []
    obj: object = model
    for attr in name.split("."):
        if obj is not None and _is_wrapper_step(obj, attr):
            obj = getattr(obj, attr, None)
            continue
        kept.append(attr)
        obj = getattr(obj, attr, None) if isinstance(obj, nn.Module) else None
    return ".".join(kept)


def param_fqns(model: nn.Module) -> dict[torch.Tensor, list[str]]:
    """Each parameter -> its canonical FQNs, the first being named_parameters()'s (tied ones have
    several; the first names its optimizer state)."""
    out: dict[torch.Tensor, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqn = canonical_fqn(model, name)
        names = out.setdefault(p, [])
        if fqn not in names:
            names.append(fqn)
    return out


def submodule_prefixes(model: nn.Module, submodules: Iterable[nn.Module] | None) -> list[str]:
    if submodules is None:
        return []
    wanted = set(submodules)
    prefixes = [canonical_fqn(model, name) + "." for name, m in model.named_modules() if m in wanted and name]
    if not prefixes:
        raise ValueError("get_state_dict: none of `submodules` is a submodule of the model")
    return prefixes
