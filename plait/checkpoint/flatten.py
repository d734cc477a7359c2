"""Nested state dict <-> flat {fqn: leaf}: the keys a checkpoint stores.

    {"model": {"w": T}, "optim": {"state": {0: {"step": T}}, "param_groups": [{...}]}}
      -> {"model.w": T, "optim.state.0.step": T, "optim.param_groups": [{...}]}

A dict, list or tuple is walked only when a tensor lies inside it (the root always is):
optimizer param_groups, a data loader's counters stay one JSON value each, loaded whole. Keys are joined with "." as torch's DCP does; two paths
that join to the same key are refused. `assign` writes a loaded value back by path,
rebuilding tuples, which cannot be assigned into.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

Path = tuple[Any, ...]


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def flatten(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Path]]:
    """({fqn: leaf value}, {fqn: path}) of a nested state dict."""
    leaves: dict[str, Any] = {}
    paths: dict[str, Path] = {}

    def walk(value: Any, path: Path) -> None:
        if isinstance(value, Mapping) and (path == () or _holds_tensor(value)):
            items = value.items()
        elif isinstance(value, (list, tuple)) and _holds_tensor(value):
            items = enumerate(value)
        else:
            fqn = ".".join(str(p) for p in path)
            if fqn in leaves:
                raise ValueError(f"state dict paths {paths[fqn]} and {path} both flatten to key "
                                 f"{fqn!r}; rename one")
            leaves[fqn], paths[fqn] = value, path
            return
        for k, v in items:
            walk(v, (*path, k))

    walk(state_dict, ())
    return leaves, paths


def assign(root: Any, path: Path, value: Any) -> Any:
    """Set root[path] = value in place; returns root (a new tuple where root was a tuple)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(root, tuple):
        items = list(root)
        items[head] = assign(items[head], rest, value)
        return type(root)(items) if type(root) is tuple else type(root)(*items)
    root[head] = assign(root[head], rest, value)
    return root
