"""Model state dicts under canonical FQNs, for any layout.

    get:  model.state_dict() (DTensor values for fully_shard / TP, plain otherwise)
          -> keys made canonical (fqn.py) -> submodules / ignore_frozen_params filters
          -> [full_state_dict: DTensors gathered] -> [cpu_offload]
    set:  {canonical fqn: value} -> [broadcast_from_rank0: rank 0's values broadcast]
          -> strict key check (before anything is copied) -> plain full tensors cut to the
          local DTensor's piece -> keys renamed to the model's own -> model.load_state_dict

FullyShardedDataParallel (FSDP1) units are read and loaded as SHARDED_STATE_DICT, whose
DTensors everything above handles as fully_shard's.
Invariant: get then set, in any two layouts of one model, gives back the same values.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from plait.checkpoint.state_dict.fqn import canonical_fqn, submodule_prefixes
from plait.checkpoint.state_dict.full import (
    broadcast_flat,
    gather_full,
    keeps_full_state,
    offload,
    to_local_layout,
)
from plait.checkpoint.state_dict.options import StateDictKeyError, StateDictOptions
from plait.tensor import DTensor


def sharded_fsdp1(model: nn.Module) -> contextlib.AbstractContextManager:
    """FullyShardedDataParallel units give their state as SHARDED_STATE_DICT within (Shard(0)
    DTensors under the original FQNs, like fully_shard's), as torch's get_state_dict sets."""
    if not any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return contextlib.nullcontext()
    from plait.fsdp import FullyShardedDataParallel, StateDictType

    return FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)


def local_model_state(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """canonical fqn -> (the model's own key, its current value)."""
    out: dict[str, tuple[str, Any]] = {}
    with sharded_fsdp1(model):
        state = model.state_dict()
    for key, value in state.items():
        fqn = canonical_fqn(model, key)
        if fqn in out:
            raise RuntimeError(f"two state dict keys {out[fqn][0]!r} and {key!r} of "
                               f"{type(model).__name__} both read as {fqn!r}")
        out[fqn] = (key, value)
    return out


def frozen_fqns(model: nn.Module) -> set[str]:
    frozen = {canonical_fqn(model, n) for n, p in model.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    if any(name.endswith("_flat_param") for name in frozen):  # FSDP1's use_orig_params=False: a
        from plait.fsdp.fsdp1.flat_param import flat_members  # frozen flat parameter's members

        for group, items in flat_members(model, lambda name: canonical_fqn(model, name)).values():
            if not group.flat_param.requires_grad:
                frozen |= {fqn for fqn, _, _ in items}
    return frozen


@torch.no_grad()
def get_model_state(model: nn.Module, options: StateDictOptions, submodules: Any = None) -> dict[str, Any]:
    state = {fqn: value for fqn, (_, value) in local_model_state(model).items()}
    prefixes = submodule_prefixes(model, submodules)
    if prefixes:
        picked: dict[str, Any] = {}
        for fqn, value in state.items():
            for prefix in prefixes:
                if fqn.startswith(prefix):
                    picked[fqn if options.keep_submodule_prefixes else fqn[len(prefix):]] = value
        state = picked
    if options.ignore_frozen_params:
        frozen = frozen_fqns(model)
        state = {k: v for k, v in state.items() if k not in frozen}
    if options.full_state_dict:
        state = gather_full(state, cpu_offload=options.cpu_offload)  # every rank takes part
        return state if keeps_full_state(options.cpu_offload) else {}
    return offload(state) if options.cpu_offload else state


def _device(local: dict[str, tuple[str, Any]]) -> torch.device:
    for _, value in local.values():
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return torch.device(value.device.type) if value.device.type == "cpu" else value.device
    return torch.device("cpu")


def key_problems(expected: set[str], given: set[str], what: str) -> tuple[list[str], list[str]]:
    return sorted(expected - given), sorted(given - expected)


def raise_key_problems(missing: list[str], unexpected: list[str], what: str) -> None:
    parts = []
    if missing:
        parts.append(f"missing key(s) {missing}")
    if unexpected:
        parts.append(f"unexpected key(s) {unexpected}")
    if parts:
        raise StateDictKeyError(f"{what}: {' and '.join(parts)}; StateDictOptions(strict=False) "
                                "loads the keys that match and returns the others")


@torch.no_grad()
def set_model_state(model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions) -> _IncompatibleKeys:
    if not isinstance(state_dict, dict):
        raise TypeError(f"model_state_dict must be a dict, got {type(state_dict).__name__}")
    local = local_model_state(model)
    expected = set(local)
    if options.ignore_frozen_params:
        expected -= frozen_fqns(model)
    if options.broadcast_from_rank0:
        def check(keys: list[str]) -> None:
            if options.strict:  # rank 0's keys may cover other stages: only missing ones count
                raise_key_problems(sorted(expected - set(keys)), [], "set_model_state_dict(broadcast_from_rank0)")
        state_dict = broadcast_flat(state_dict, device=_device(local), wanted=expected.__contains__, check=check)
    elif not state_dict:
        return _IncompatibleKeys([], [])
    missing, unexpected = key_problems(expected, set(state_dict), "set_model_state_dict")
    if options.strict:
        raise_key_problems(missing, unexpected, "set_model_state_dict")
    # a model built on the meta device has no storage to copy into: assign, as torch does (then
    # each parameter takes the loaded tensor; fully_shard adopts its new sharded DTensors)
    assign = any(isinstance(v, torch.Tensor) and v.is_meta for _, v in local.values())
    own: dict[str, Any] = {}
    for fqn, value in state_dict.items():
        if fqn not in local:
            continue
        key, current = local[fqn]
        value = to_local_layout(fqn, value, current)
        own[key] = _own_storage(value) if assign else value
    with sharded_fsdp1(model):
        model.load_state_dict(own, strict=False, assign=assign)
    return _IncompatibleKeys(missing, unexpected)


def _own_storage(value: Any) -> Any:
    """A tensor that will be assigned into the model, holding only its own elements: a shard cut
    from a full tensor is a view that would keep the whole full tensor alive on every rank."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():
            return DTensor(local.clone(), value._spec, requires_grad=value.requires_grad)
        return value
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.numel() * value.element_size():
        return value.clone()
    return value
