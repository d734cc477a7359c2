"""parallelize_module: apply a plan of parallel styles to a module, in place.

    plan = ParallelStyle                      -> applied to `module` itself
         | {fqn pattern: ParallelStyle, ...}  -> applied to every submodule the pattern matches
    pattern: dotted module names, each token matched with fnmatch ("layers.*.attention.wq");
             "" is the module itself

Every check runs before any style is applied (so before anything is sent): the mesh is
1-D, every pattern matches at least one submodule (else the error names the pattern and
the closest FQNs), and every style can handle each module it matches. Entries are then
applied in plan order, matches in module registration order (torch's order).

Where plait is stricter than torch: torch warns and skips an entry that matches nothing
(a typo then trains an unsharded layer); plait raises. Without a device_mesh torch takes
the enclosing `with mesh:`; plait, which has no mesh context, takes a 1-D mesh of all ranks.
"""

from __future__ import annotations

import difflib
import warnings
from fnmatch import fnmatchcase

from torch import nn

from plait import comm
from plait.device_mesh import DeviceMesh, init_device_mesh
from plait.tensor.parallel.style import ParallelStyle


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply `parallelize_plan` to `module` on the 1-D `device_mesh`; return `module`."""
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan; auto-parallel is not supported, so it "
                      "does nothing (as torch)", stacklevel=2)
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan = {"": parallelize_plan}
    if not isinstance(parallelize_plan, dict):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict of module FQN -> ParallelStyle, "
                        f"got {type(parallelize_plan).__name__}")
    mesh = _mesh(device_mesh, module)
    matches = resolve_plan(module, parallelize_plan)
    for fqn, sub, style in matches:
        style._check_module(sub, fqn)
    for _, sub, style in matches:
        style.src_data_rank = src_data_rank
        style._apply(sub, mesh)
    return module


def _mesh(device_mesh: DeviceMesh | None, module: nn.Module) -> DeviceMesh:
    if device_mesh is None:
        # torch takes the mesh of an enclosing `with mesh:`; plait has no mesh context, so
        # (as a world-sized 1-D mesh is what that would be for tensor parallel alone) all ranks
        param = next(module.parameters(), None)
        device_type = param.device.type if param is not None and param.device.type != "meta" else "cpu"
        if not comm.is_initialized():
            raise ValueError("parallelize_module got no device_mesh and no process group is running; pass "
                             "device_mesh (e.g. init_device_mesh('cpu', (world_size,)) or mesh['tp'])")
        return init_device_mesh(device_type, (comm.world_size(),))
    if device_mesh.ndim != 1:
        raise ValueError(f"parallelize_module takes a 1-D device mesh, got one of shape {tuple(device_mesh.shape)}"
                         f"{' ' + str(device_mesh.mesh_dim_names) if device_mesh.mesh_dim_names else ''}; "
                         "slice it first, e.g. mesh['tp']")
    return device_mesh


def resolve_plan(module: nn.Module, plan: dict[str, ParallelStyle]) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(fqn, submodule, style) for every plan entry and submodule it matches, in plan order;
    a ValueError for an entry that matches nothing or a value that is not a style."""
    named = [(fqn, m) for fqn, m in module.named_modules(remove_duplicate=False)]
    seen: set[str] = set()
    named = [(fqn, m) for fqn, m in named if not (fqn in seen or seen.add(fqn))]
    out = []
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan entry {pattern!r} maps to {type(style).__name__}, not a ParallelStyle")
        hits = [(fqn, m) for fqn, m in named if fqn_matches(pattern, fqn)]
        if not hits:
            fqns = [fqn for fqn, _ in named if fqn]
            close = difflib.get_close_matches(pattern, _like(pattern, fqns), n=3, cutoff=0.4)
            hint = f"closest: {close}" if close else f"the module's submodules start {fqns[:5]}"
            raise ValueError(f"plan entry {pattern!r} matches no submodule of {type(module).__name__} ({hint})")
        out += [(fqn, m, style) for fqn, m in hits]
    return out


def _like(pattern: str, fqns: list[str]) -> list[str]:
    """The FQNs with the tokens a wildcard of `pattern` matches written as that wildcard
    ("layers.3.w1" -> "layers.*.w1"), once each: what a misspelt pattern is compared to."""
    tokens = pattern.split(".")
    out: dict[str, None] = {}
    for fqn in fqns:
        parts = fqn.split(".")
        if len(parts) == len(tokens):
            parts = [t if any(c in t for c in "*?[") and fnmatchcase(p, t) else p for p, t in zip(parts, tokens)]
        out[".".join(parts)] = None
    return list(out)


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether dotted `fqn` matches `pattern` token by token (fnmatch per token)."""
    if pattern == "":
        return fqn == ""
    tokens, parts = pattern.split("."), fqn.split(".") if fqn else []
    return len(tokens) == len(parts) and all(fnmatchcase(p, t) for p, t in zip(parts, tokens))


__all__ = ["fqn_matches", "parallelize_module", "resolve_plan"]
