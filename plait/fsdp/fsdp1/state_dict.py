"""FullyShardedDataParallel's state dicts, optimizer state dicts and summon_full_params.

    model.state_dict() under FSDP.state_dict_type(model, T, config):
        every unit's post-hook: `{p}_fsdp_wrapped_module.x` -> `{p}x`, then its values by T:
        FULL_STATE_DICT     DTensor -> full_tensor() (an all-gather per parameter, on every
                            rank, in the dict's order); offload_to_cpu -> CPU; rank0_only ->
                            ranks > 0 keep nothing; buffers back in their own dtype
        SHARDED_STATE_DICT  the engine's Shard(0) DTensors, under the original FQNs (what
                            plait.checkpoint saves and loads, resharding as needed)
        LOCAL_STATE_DICT    each DTensor's local shard, a plain tensor
    model.load_state_dict(sd): each unit's pre-hook adds its prefix back and turns a full
        tensor into this rank's chunk (or a local shard into a DTensor) of its parameter,
        so the module's own loading copies shard into shard.
    FSDP.optim_state_dict / optim_state_dict_to_load: optim_state.py.

The default, as torch's, is FULL_STATE_DICT with FullStateDictConfig() (every rank gets
the full tensors). Every rank must call state_dict()/optim_state_dict() together: FULL
gathers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.activation_checkpointing.wrapper import replace_prefix
from plait.fsdp.fsdp1 import flat_param as flat
from plait.fsdp.fsdp1.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from plait.fsdp.param import set_grad
from plait.tensor import DTensor

_PREFIX = "_fsdp_wrapped_module."
_AC_PREFIX = "_checkpoint_wrapped_module."


def _clean(name: str) -> str:
    return name.replace(_PREFIX, "").replace(_AC_PREFIX, "")

_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def install(unit: nn.Module) -> None:
    unit._state_dict_settings = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                                  FullOptimStateDictConfig())
    # (after the engine's pre-hooks, which reshard) use_orig_params=False: the original names
    # hold the sharded DTensors while the dicts are built or loaded, the flat parameter none
    unit.register_state_dict_pre_hook(lambda m, *args: flat.expose(m))
    unit._register_state_dict_hook(_post_state_dict)
    unit.register_load_state_dict_pre_hook(_pre_load_state_dict)
    unit.register_load_state_dict_post_hook(lambda m, *args: flat.hide(m))


def _units(module: nn.Module) -> list[nn.Module]:
    from plait.fsdp.fsdp1.wrapper import FullyShardedDataParallel

    return FullyShardedDataParallel.fsdp_modules(module)


# -- state_dict ----------------------------------------------------------------------------


def _post_state_dict(unit: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> dict[str, Any]:
    flat.hide(unit)
    replace_prefix(state_dict, prefix + _PREFIX, prefix)
    settings = unit._state_dict_settings
    kind, config = settings.state_dict_type, settings.state_dict_config
    orig_dtypes = _buffer_dtypes_by_key(unit, prefix)
    drop = kind is StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False) \
        and comm.global_rank() != 0
    gathered = _gather_unit(unit, prefix) if kind is StateDictType.FULL_STATE_DICT else {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict[key]
        if isinstance(value, DTensor):
            if kind is StateDictType.FULL_STATE_DICT:
                value = gathered[key] if key in gathered else value.full_tensor()
            elif kind is StateDictType.LOCAL_STATE_DICT:
                value = value._local_tensor
        elif key in orig_dtypes:
            value = value.to(orig_dtypes[key])
        if config.offload_to_cpu and not isinstance(value, DTensor) and isinstance(value, torch.Tensor):
            value = value.cpu()
        if drop:
            del state_dict[key]
        else:
            state_dict[key] = value
    return state_dict


def _gather_unit(unit: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The unit's full parameters by state-dict key, from one all-gather of its group (the
    engine's unshard), where the group gathers in the parameters' own dtype; {} otherwise
    (mixed precision: each DTensor is gathered on its own, in its dtype)."""
    group = unit._plait_fsdp_state.group
    if group is None or any(fp.orig_dtype != group.param_dtype for fp in group.params):
        return {}
    paths = {id(m): path for path, m in nn.Module.named_modules(unit)}
    was_unsharded = group.is_unsharded
    if was_unsharded or group.gather_pending or any(fp.tp_spec is not None for fp in group.params):
        group.unshard()  # (summon_full_params, SHARD_GRAD_OP between forward and backward)
        with torch.no_grad():
            fulls = [fp.unsharded.detach().clone() for fp in group.params]  # the flat buffer is freed on reshard
        if not was_unsharded:
            group.reshard()
    else:
        fulls = group.gather_full()  # new tensors, straight from the all-gather's output
    out = {}
    for fp, full in zip(group.params, fulls):
        for module, name in fp.sites:
            out[prefix + _clean(paths[id(module)] + "." if paths[id(module)] else "") + name] = full
    return out


def _buffer_dtypes_by_key(unit: nn.Module, prefix: str) -> dict[str, torch.dtype]:
    if not unit._buffer_dtypes:
        return {}
    out = {}
    for path, m in nn.Module.named_modules(unit):
        for key in m._buffers:
            dtype = unit._buffer_dtypes.get((id(m), key))
            if dtype is not None:
                out[prefix + _clean(path + "." if path else "") + key] = dtype
    return out


def _pre_load_state_dict(unit: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Add the wrapper's prefix back; give each of this unit's parameters a DTensor shard."""
    replace_prefix(state_dict, prefix, prefix + _PREFIX)
    group = unit._plait_fsdp_state.group
    if group is None:
        return
    flat.expose(unit)
    paths = {id(m): path for path, m in nn.Module.named_modules(unit)}
    for fp in group.params:
        for module, name in fp.sites:
            # inner activation-checkpoint wrappers add their prefix when loading reaches them
            key = prefix + (paths[id(module)] + "." if paths[id(module)] else "").replace(_AC_PREFIX, "") + name
            value = state_dict.get(key)
            if value is not None and not isinstance(value, DTensor):
                state_dict[key] = _to_shard(value, fp, key)


def _to_shard(value: torch.Tensor, fp: Any, key: str) -> DTensor:
    """A full tensor (FULL) or this rank's shard (LOCAL) -> a DTensor laid out as fp's."""
    spec = fp.sharded._spec
    local_shape = tuple(fp.local.shape)
    if tuple(value.shape) == tuple(fp.shape):  # this rank's block, whatever the placements (TP too)
        for d, (size, start) in enumerate(zip(spec.local_shape, spec.local_offset)):
            value = value.narrow(d, start, size)
    elif tuple(value.shape) != local_shape:
        raise ValueError(f"state dict entry {key!r} has shape {tuple(value.shape)}; expected the full "
                         f"{tuple(fp.shape)} (FULL_STATE_DICT) or this rank's shard {local_shape} "
                         "(LOCAL_STATE_DICT)")
    local = value.detach().to(device=fp.local.device, dtype=fp.local.dtype).contiguous()
    return DTensor(local, spec, requires_grad=False)


# -- state_dict_type -----------------------------------------------------------------------


def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
    """Set the state-dict type (and configs) of every FSDP unit under `module`; returns the
    previous settings."""
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"state_dict_type must be a StateDictType, got {state_dict_type!r}")
    config_cls, optim_cls = _CONFIGS[state_dict_type]
    config = state_dict_config if state_dict_config is not None else config_cls()
    optim_config = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
    for given, cls, what in ((config, config_cls, "state_dict_config"),
                             (optim_config, optim_cls, "optim_state_dict_config")):
        if type(given) is not cls:
            raise ValueError(f"{state_dict_type.name} takes a {what} of type {cls.__name__}, got "
                             f"{type(given).__name__}")
    units = _units(module)
    if not units:
        raise ValueError(f"{type(module).__name__} holds no FullyShardedDataParallel unit")
    previous = units[0]._state_dict_settings
    for u in units:
        u._state_dict_settings = StateDictSettings(state_dict_type, config, optim_config)
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    units = _units(module)
    if not units:
        raise ValueError(f"{type(module).__name__} holds no FullyShardedDataParallel unit")
    settings = {(s.state_dict_type, repr(s.state_dict_config), repr(s.optim_state_dict_config))
                for s in (u._state_dict_settings for u in units)}
    if len(settings) > 1:
        raise ValueError(f"the FSDP units of {type(module).__name__} have different state-dict settings "
                         f"{sorted(settings)}; set them together with FSDP.set_state_dict_type(model, ...)")
    return units[0]._state_dict_settings


@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                    state_dict_config: StateDictConfig | None = None,
                    optim_state_dict_config: OptimStateDictConfig | None = None) -> Iterator[None]:
    """Within, every unit under `module` uses this state-dict type; restored after."""
    previous = {id(u): u._state_dict_settings for u in _units(module)}
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for u in _units(module):
            u._state_dict_settings = previous.get(id(u), u._state_dict_settings)


# -- summon_full_params --------------------------------------------------------------------


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False) -> Iterator[None]:
    """Within, every unit's parameters are whole (in their own dtype) on the modules; on
    exit what was written to them is kept (writeback) and they are sharded again."""
    from plait.fsdp.fully_shard import _states

    if rank0_only and writeback:
        raise ValueError("summon_full_params(rank0_only=True, writeback=True) is not supported (as in torch): "
                         "ranks > 0 hold no full parameters to write back; pass writeback=False")
    states = list(_states(module, recurse))
    if not states:
        raise ValueError(f"{type(module).__name__} holds no FSDP unit to summon parameters of")
    keep = not rank0_only or comm.global_rank() == 0
    full: list[tuple[Any, nn.Parameter]] = []
    summoned: list[nn.Module] = []  # use_orig_params=False units
    for s in states:
        if s.training_state.name != "IDLE":
            raise RuntimeError(f"summon_full_params cannot run inside forward or backward ({s.name} is in "
                               f"{s.training_state.name})")
        if s.group is None:
            continue
        s.group.reshard()
        unit = s.modules[0]
        flat_grad = None
        if s.group.flat_param is not None:  # torch's: the flat parameter is hidden within
            flat_grad = s.group.flat_param.grad
            unit._flat_owner._parameters[flat.FLAT_PARAM] = None
            unit._summoning += 1
            summoned.append(unit)
        for fp, off in zip(s.group.params, s.group.offsets):
            sharded_grad = fp.sharded.grad if flat_grad is None else flat.piece(flat_grad, fp, off)
            with torch.no_grad():
                whole = fp.sharded.detach().full_tensor()
                grad = sharded_grad.full_tensor() if with_grads and sharded_grad is not None else None
            if offload_to_cpu:
                whole = whole.cpu()
            p = nn.Parameter(whole, requires_grad=fp.requires_grad)
            set_grad(p, grad)  # keep_low_precision_grads: a grad of the compute dtype
            if keep:
                fp.register(p)
            full.append((fp, p))
    try:
        yield
    finally:
        for fp, p in full:
            if writeback and keep:
                spec, piece = fp.sharded._spec, p.detach()
                for d, (size, start) in enumerate(zip(spec.local_shape, spec.local_offset)):
                    piece = piece.narrow(d, start, size)  # this rank's block (over TP too)
                with torch.no_grad():
                    fp.local.copy_(piece)
            fp.register_resting()
        for unit in summoned:
            unit._summoning -= 1
            unit._flat_owner._parameters[flat.FLAT_PARAM] = unit._state.group.flat_param


__all__ = ["get_state_dict_type", "install", "set_state_dict_type", "state_dict_type", "summon_full_params"]
