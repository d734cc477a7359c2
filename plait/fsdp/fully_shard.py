"""fully_shard: torch's FSDP2 entry point, and FSDPModule, the class it mixes in.

    fully_shard(block) for each block, then fully_shard(model):
        managed modules: `module`'s subtree minus subtrees an earlier call manages
        each managed parameter -> FSDPParam (Shard(0) DTensor registered in its place)
        -> one ParamGroup -> one FSDPState (hooks) -> module.__class__ = FSDP<Class>

A parameter belongs to exactly one group: a weight tied between two groups would be
reduced twice, so it is refused here, naming both places (group them with
fully_shard([a, b]) or shard their common parent). Buffers are not sharded; they move to
the mesh's device like the parameters.

Over tensor parallel (parameters already DTensors on a 1-D mesh["tp"], `mesh` is mesh["dp"]
or the HSDP slice mesh["dp_replicate", "dp_shard"] of the same root, of any number of axes):
FSDP shards dim 0 of each TP-local tensor over dp, as torch does (`shard_placement_fn` picks
another dim), so a dim TP shards too gets torch's (_StridedShard(0, sf=tp), Shard(0)) and
every parameter's placements, local values and state dict equal torch's (param.dp_tp_layout).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.device_mesh import DeviceMesh, init_device_mesh
from plait.fsdp.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from plait.fsdp.group import ParamGroup
from plait.fsdp.param import FSDPParam
from plait.fsdp.state import FSDPState
from plait.tensor import DTensor, Shard

_OWNER = "_plait_fsdp_owner"  # set on an original parameter: the group that took it


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, as torch's
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
) -> Any:
    """Shard `module`'s parameters over `mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP) and
    gather them around its forward and backward; returns `module`, now an FSDPModule.

    reshard_after_forward: True frees the unsharded parameters after forward and gathers
    again in backward; False keeps them; an int k (a factor of the shard axis size) keeps them
    sharded over k ranks after forward, so backward's all-gather runs within k consecutive
    ranks (torch's meaning: e.g. k = ranks per node); None (torch's default) is True except for the
    root."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard takes an nn.Module or a list of them, got {type(module).__name__}")
    shard_modules(modules, mesh=mesh, reshard_after_forward=reshard_after_forward,
                  shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
                  ignored_params=ignored_params, mix_in=True)
    return module


def shard_modules(
    modules: list[nn.Module],
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    mix_in: bool,
) -> FSDPState:
    """The one implementation behind both front doors: shard what `modules` manage into one
    group and install the hooks. `mix_in` makes each module an FSDPModule (fully_shard);
    FullyShardedDataParallel, a wrapper, keeps its own class."""
    name = ", ".join(_describe(m) for m in modules)
    for m in modules:
        if getattr(m, "_plait_fsdp_state", None) is not None:
            raise ValueError(f"fully_shard was already applied to {_describe(m)}; apply it once per module")
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard({name}) got a {mesh.ndim}-D mesh {mesh.shape}; it takes a 1-D mesh "
                         "(FSDP) or a 2-D (replicate, shard) mesh (HSDP); slice yours, e.g. mesh['dp']")
    reshard_after_forward, post_forward_size = _post_forward(reshard_after_forward, mesh, name)
    device = _device(mesh)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    shard_device = torch.device("cpu") if offload else device
    ignored = set(map(id, ignored_params or ()))

    managed = _managed_modules(modules)
    sites: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for m in managed:
        for key, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            _check_param(p, key, m, name, mesh)
            sites.setdefault(id(p), (p, []))[1].append((m, key))
        for key, b in m._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                _check_device(b, f"buffer {key!r}", m, name, mesh)
                m._buffers[key] = b.to(device)

    placements = []  # every placement checked before any parameter is replaced
    for p, where in sites.values():
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None
        if placement is not None and not isinstance(placement, Shard):
            raise TypeError(f"shard_placement_fn returned {placement!r} for a parameter of {name}; return a "
                            "Shard(dim) or None")
        placement = placement if placement is not None else Shard(0)
        if p.dim() == 0 or not -p.dim() <= placement.dim < p.dim():
            raise ValueError(f"fully_shard({name}): cannot shard parameter {where[0][1]!r} of shape "
                             f"{tuple(p.shape)} on dim {placement.dim}; scalars are not supported, "
                             "reshape them to (1,)")
        placements.append(placement)
    fsdp_params = []
    for (p, where), placement in zip(sites.values(), placements):
        fp = FSDPParam(p, where, mesh, placement, shard_device=shard_device,
                       pin_memory=offload and offload_policy.pin_memory)
        setattr(p, _OWNER, name)
        fp.register(fp.sharded)
        fsdp_params.append(fp)

    group = None
    if fsdp_params:
        group = ParamGroup(fsdp_params, mesh, device=device, param_dtype=mp_policy.param_dtype,
                           reduce_dtype=mp_policy.reduce_dtype, name=name)
        group.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        group.set_post_forward_size(post_forward_size)
    state = FSDPState(modules, group, mp_policy=mp_policy, name=name,
                      auto_reshard_after_forward=reshard_after_forward is None)
    for m in modules:
        m._plait_fsdp_state = state
        if mix_in:
            m.__class__ = _fsdp_class(type(m))
    if group is not None:
        _register_state_dict_hooks(modules, group)
    return state


def _register_state_dict_hooks(modules: list[nn.Module], group: ParamGroup) -> None:
    """state_dict and load_state_dict always see the sharded DTensors (unsharded ones are
    freed first); a load with assign=True registers new parameters, which the group adopts."""

    def to_sharded(*args: Any, **kwargs: Any) -> None:
        group.reshard()

    def adopt(*args: Any, **kwargs: Any) -> None:
        for p in group.params:
            p.refresh_sharded()

    for m in modules:
        m.register_state_dict_pre_hook(to_sharded)
        m._register_load_state_dict_pre_hook(to_sharded)
        m.register_load_state_dict_post_hook(adopt)


def _post_forward(reshard_after_forward: bool | int | None, mesh: DeviceMesh,
                  name: str) -> tuple[bool | None, int | None]:
    """(the bool knob, k) for reshard_after_forward, with torch's meaning of an int k: after
    forward keep the parameters sharded over k ranks, so backward all-gathers within k."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    if not isinstance(reshard_after_forward, int):
        raise TypeError(f"fully_shard({name}): reshard_after_forward must be a bool, an int or None, "
                        f"got {type(reshard_after_forward).__name__}")
    world = mesh.size(mesh.ndim - 1)
    k = reshard_after_forward
    if not 1 <= k <= world or world % k:
        raise ValueError(f"fully_shard({name}): reshard_after_forward={k} must be a factor of the shard "
                         f"axis size {world} (a group size to reshard to after forward)")
    if k == 1:
        warnings.warn(f"fully_shard({name}): reshard_after_forward=1 (an int) keeps the parameters "
                      "unsharded after forward, as reshard_after_forward=False does", stacklevel=3)
        return False, None
    return (True, None) if k == world else (True, k)


def _describe(m: nn.Module) -> str:
    """The module's own class name (FSDP<Class> after fully_shard says Class)."""
    cls = type(m)
    return cls.__mro__[2].__name__ if cls.__dict__.get("_plait_fsdp_mixed_in") else cls.__name__


def _default_mesh() -> DeviceMesh:
    device_type = "cuda" if comm.default_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (comm.world_size(),))


def _device(mesh: DeviceMesh) -> torch.device:
    acc = torch.accelerator.current_accelerator()
    if acc is not None and mesh.device_type == acc.type:  # the device this rank's process uses
        return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device(mesh.device_type)


def _managed_modules(roots: list[nn.Module]) -> list[nn.Module]:
    """The roots' subtrees, minus the subtrees of modules an earlier fully_shard manages."""
    seen, out = set(), []

    def visit(m: nn.Module, is_root: bool) -> None:
        if id(m) in seen or (not is_root and getattr(m, "_plait_fsdp_state", None) is not None):
            return
        seen.add(id(m))
        out.append(m)
        for child in m.children():
            visit(child, False)

    for r in roots:
        visit(r, True)
    return out


def _check_device(t: torch.Tensor, what: str, m: nn.Module, name: str, mesh: DeviceMesh) -> None:
    if t.is_meta or t.device.type in ("cpu", mesh.device_type):
        if mesh.device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"fully_shard({name}): the mesh is on cuda, which this process cannot use, and "
                             f"{what} of {_describe(m)} is on {t.device}; build the mesh on "
                             f"{t.device.type!r}")
        return
    raise ValueError(f"fully_shard({name}): {what} of {_describe(m)} is on {t.device}, but the mesh is on "
                     f"{mesh.device_type!r}; move the module to {mesh.device_type!r} first")


def _check_param(p: nn.Parameter, key: str, m: nn.Module, name: str, mesh: DeviceMesh) -> None:
    owner = getattr(p, _OWNER, None)
    if owner is not None:
        raise ValueError(
            f"parameter {key!r} of {_describe(m)} is shared with group fully_shard({owner}), which already "
            f"shards it; a parameter belongs to one group: put the modules that share it in one call, "
            f"fully_shard([a, b]), or shard their common parent")
    if isinstance(p, DTensor):
        _check_tp_param(p, key, m, name, mesh)
        return
    _check_device(p, f"parameter {key!r}", m, name, mesh)


def _check_tp_param(p: DTensor, key: str, m: nn.Module, name: str, mesh: DeviceMesh) -> None:
    """A DTensor parameter must come from tensor parallel on a 1-D mesh of the root that
    `mesh` (FSDP's axes) was sliced from, on another axis."""
    tp = p.device_mesh
    where = f"fully_shard({name}): parameter {key!r} of {_describe(m)} is a DTensor on {tp}"
    if tp.ndim != 1 or any(pl.is_partial() for pl in p.placements):
        raise ValueError(f"{where} with placements {p.placements}; fully_shard composes with a 1-D "
                         "tensor-parallel mesh and Shard/Replicate placements (parallelize_module's)")
    if tp._root != mesh._root or tp._root is tp or not tp.mesh_dim_names or not mesh.mesh_dim_names \
            or set(tp._axes[0]) & {a for axis in mesh._axes for a in axis}:
        raise ValueError(f"{where}, but FSDP's mesh is {mesh}; slice both from one mesh with named "
                         "axes: parallelize_module(model, mesh['tp'], ...) then fully_shard(block, "
                         "mesh=mesh['dp']) (HSDP: mesh['dp_replicate', 'dp_shard'])")


@functools.cache
def _fsdp_class(cls: type) -> type:
    """FSDP<cls>: FSDPModule first in the MRO, so isinstance holds for both."""
    from plait.fsdp.module import FSDPModule

    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__,
                                                           "_plait_fsdp_mixed_in": True})


def _states(module: nn.Module, recurse: bool) -> Iterable[FSDPState]:
    seen = []
    for m in (module.modules() if recurse else [module]):
        state = getattr(m, "_plait_fsdp_state", None)
        if state is not None and state not in seen:
            seen.append(state)
    return seen


__all__ = ["fully_shard", "shard_modules"]
