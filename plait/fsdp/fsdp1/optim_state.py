"""FullyShardedDataParallel's optimizer state dicts, keyed by parameter FQN (torch's
FSDP.optim_state_dict and optim_state_dict_to_load).

    optim_state_dict(model, optim): optim.state_dict() (keyed by position) -> each position's
        FQN (a flat parameter's, use_orig_params=False: the FQNs of the parameters in it, its
        (S,) state tensors split into their pieces, each a DTensor laid out as the parameter's
        shard) -> values per the model's state-dict type: FULL gathers (rank0_only: ranks > 0
        get {}), SHARDED keeps the DTensors, LOCAL their local shards
    optim_state_dict_to_load(model, optim, osd): the way back: any of the three types ->
        keyed by position, each tensor this rank's shard (a flat parameter's pieces packed
        into one (S,) tensor, padding zero; its step one copied scalar)

A parameter's name is the clean FQN (no `_fsdp_wrapped_module.` or
`_checkpoint_wrapped_module.`), its first place for a tied one, as torch's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait import comm
from plait.fsdp.fsdp1 import flat_param as flat
from plait.fsdp.fsdp1.api import StateDictType
from plait.fsdp.fsdp1.state_dict import _clean, _to_shard, get_state_dict_type
from plait.tensor import DTensor


def _fqns(model: nn.Module) -> dict[int, str]:
    return {id(p): _clean(name) for name, p in model.named_parameters()}


def _optim_params(optim: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in optim.param_groups for p in g["params"]]


def _param_fqns(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[list[list[str]], dict]:
    """Each of optim's parameters -> its FQNs (a flat parameter's: those of the parameters
    in it, in order), and the flat parameters' members (flat.flat_members)."""
    fqn_of = _fqns(model)
    members = flat.flat_members(model, _clean)
    out = []
    for p in _optim_params(optim):
        if id(p) in members:
            out.append([fqn for fqn, _, _ in members[id(p)][1]])
        elif id(p) in fqn_of:
            out.append([fqn_of[id(p)]])
        else:
            raise ValueError(f"optim steps on a parameter of shape {tuple(p.shape)} that is not one of "
                             f"{type(model).__name__}'s; build the optimizer on model.parameters()")
    return out, members


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                     optim_state_dict: dict[str, Any] | None = None, group: Any = None) -> dict[str, Any]:
    """optim's state keyed by parameter FQN (the model's names), values per the model's
    state-dict type: FULL gathers (rank0_only: ranks > 0 get {}), SHARDED keeps DTensors.
    A flat parameter's state is split into its parameters' (each a DTensor laid out as the
    parameter's shard, then converted the same way)."""
    settings = get_state_dict_type(model)
    kind, config = settings.state_dict_type, settings.optim_state_dict_config
    osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
    names, members = _param_fqns(model, optim)
    params = _optim_params(optim)

    def convert(v: Any) -> Any:
        if isinstance(v, DTensor):
            v = v.full_tensor() if kind is StateDictType.FULL_STATE_DICT else \
                v._local_tensor if kind is StateDictType.LOCAL_STATE_DICT else v
        if config.offload_to_cpu and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
            v = v.cpu()
        return v

    state = {}
    for index, fqns in enumerate(names):
        if index not in osd["state"]:
            continue
        entry = osd["state"][index]
        keys = sorted(entry)  # the same order on every rank: FULL gathers
        if id(params[index]) not in members:
            state[fqns[0]] = {k: convert(entry[k]) for k in keys}
            continue
        group_, items = members[id(params[index])]
        for fqn, fp, off in items:
            state[fqn] = {k: convert(flat.piece(entry[k], fp, off) if flat.is_flat_state(entry[k], group_)
                                     else entry[k]) for k in keys}
    if kind is StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False) and comm.global_rank() != 0:
        return {}
    groups = []
    pos = 0
    for g in osd["param_groups"]:
        groups.append({**g, "params": [f for fqns in names[pos:pos + len(g["params"])] for f in fqns]})
        pos += len(g["params"])
    return {"state": state, "param_groups": groups}


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                             is_named_optimizer: bool = False, load_directly: bool = False,
                             group: Any = None) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (any of the three types) -> what
    optim.load_state_dict takes: keyed by position, each tensor this rank's shard (a flat
    parameter's: its parameters' shards packed into one (S,) tensor, padding zero)."""
    names, members = _param_fqns(model, optim)
    params = _optim_params(optim)
    index_of = {fqn: i for i, fqns in enumerate(names) for fqn in fqns}
    from plait.fsdp.fully_shard import _states

    fsdp_params = {id(fp.sharded): fp for s in _states(model, True) if s.group for fp in s.group.params}
    missing = [fqn for fqn in optim_state_dict["state"] if fqn not in index_of]
    if missing:
        raise ValueError(f"optimizer state for {missing[:4]}, which {type(model).__name__}'s optimizer does not "
                         f"step; its parameters are {sorted(index_of)[:4]}...")
    state = {}
    for i, fqns in enumerate(names):
        entries = [optim_state_dict["state"].get(fqn) for fqn in fqns]
        if all(e is None for e in entries):
            continue
        if id(params[i]) not in members:
            fp = fsdp_params.get(id(params[i]))
            state[i] = {k: _to_shard(v, fp, f"{fqns[0]}.{k}") if fp is not None and isinstance(v, torch.Tensor)
                        and not isinstance(v, DTensor) and v.dim() > 0 else v for k, v in entries[0].items()}
            continue
        absent = [fqn for fqn, e in zip(fqns, entries) if e is None]
        if absent:
            raise ValueError(f"optimizer state for {len(fqns) - len(absent)} of the {len(fqns)} parameters "
                             f"flattened together, but none for {absent[:4]}: one flat parameter has one state")
        group_, items = members[id(params[i])]
        packed = {}
        for k, v in entries[0].items():
            if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                # step: one scalar for the flat parameter, a copy: the optimizer steps it in place
                packed[k] = v.clone() if isinstance(v, torch.Tensor) else v
                continue
            buf = torch.zeros(group_.total, dtype=v.dtype, device=params[i].device)  # (S,)
            for (fqn, fp, off), e in zip(items, entries):
                value = e[k]
                local = value._local_tensor if isinstance(value, DTensor) else \
                    _to_shard(value, fp, f"{fqn}.{k}")._local_tensor
                buf[off:off + fp.local_numel].copy_(local.reshape(-1))
            packed[k] = buf
        state[i] = packed
    groups = [{**g, "params": list(dict.fromkeys(index_of[f] for f in g["params"]))}
              for g in optim_state_dict["param_groups"]]
    out = {"state": state, "param_groups": groups}
    if load_directly:
        optim.load_state_dict(out)
    return out


__all__ = ["optim_state_dict", "optim_state_dict_to_load"]
