"""Optimizer state keyed by parameter name or by position: `OptimStateKeyType`, `rekey_optim_state_dict`.

    optim.state_dict()            {"state": {0: ..., 1: ...}, "param_groups": [{"params": [0, 1]}]}
      ──rekey(PARAM_NAME, model)──▶ {"state": {"w": ..., "b": ...}, "param_groups": [{"params": ["b", "w"]}]}
      ──rekey(PARAM_ID, model)────▶ back, by the optimizer's (or optim_input's, or the model's) order

torch's FSDP1 API (`FSDP.rekey_optim_state_dict`): lets a checkpoint saved from a plain model's
optimizer load into a wrapped one and back. Names are the model's own (clean) fqns; ids are
positions in the optimizer's flattened param groups, as torch.optim numbers them.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from enum import Enum, auto
from typing import Any

import torch
from torch import nn


class OptimStateKeyType(Enum):
    """The type of key in an optimizer state dict (torch's)."""

    PARAM_NAME = auto()
    PARAM_ID = auto()


def _ordered_params(model: nn.Module, optim_input: Iterable | None,
                    optim: torch.optim.Optimizer | None) -> list[nn.Parameter]:
    """The parameters in the order torch.optim gives them ids."""
    if optim is not None:
        return [p for g in optim.param_groups for p in g["params"]]
    if optim_input is None:
        return list(model.parameters())
    items = list(optim_input)
    if items and isinstance(items[0], dict):  # param groups
        return [p for g in items for p in g["params"]]
    return items


def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                           model: nn.Module, optim_input: Iterable | None = None,
                           optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """`optim_state_dict` with its keys turned into `optim_state_key_type` (a copy; unchanged if already so)."""
    if not isinstance(optim_state_key_type, OptimStateKeyType):
        raise TypeError(f"optim_state_key_type must be OptimStateKeyType.PARAM_NAME or PARAM_ID, "
                        f"got {optim_state_key_type!r}")
    if optim_input is not None:
        warnings.warn("rekey_optim_state_dict(optim_input=...) is deprecated, as in torch: pass optim=",
                      FutureWarning, stacklevel=2)
    keys = list(optim_state_dict["state"])
    if not (all(isinstance(k, str) for k in keys) or all(isinstance(k, int) for k in keys)):
        raise ValueError(f"optimizer state keys mix names and ids: {keys[:6]}; rekey a state dict of one kind")
    want_names = optim_state_key_type is OptimStateKeyType.PARAM_NAME
    if keys and isinstance(keys[0], str) == want_names:
        return optim_state_dict
    params = _ordered_params(model, optim_input, optim)
    from plait.fsdp.fully_shard import _states

    if any(s.group is not None and s.group.flat_param is not None for s in _states(model, True)):
        # torch maps each flat parameter's id to the names of the parameters in it; plait's flat
        # layout differs from torch's (flat_param.py), so ids keyed by flat parameter would not load
        raise ValueError(f"rekey_optim_state_dict does not take {type(model).__name__} with "
                         "FullyShardedDataParallel(use_orig_params=False) units: key by name with "
                         "FSDP.optim_state_dict(model, optim) and load with FSDP.optim_state_dict_to_load, "
                         "or wrap with use_orig_params=True")
    name_of = {id(p): fqn for fqn, p in model.named_parameters(remove_duplicate=False)}
    missing = [i for i, p in enumerate(params) if id(p) not in name_of]
    if missing:
        raise ValueError(f"the optimizer's parameters at ids {missing[:6]} are not parameters of "
                         f"{type(model).__name__}; pass the model the optimizer was built on")
    names = [name_of[id(p)] for p in params]
    if want_names:
        mapping: dict[Any, Any] = dict(enumerate(names))
    else:
        mapping = {name: i for i, name in enumerate(names)}
    unknown = [k for k in keys if k not in mapping]
    if unknown:
        raise ValueError(f"optimizer state for {unknown[:6]}, which is not among {type(model).__name__}'s "
                         f"{len(mapping)} optimized parameters")
    out: dict[str, Any] = {"state": {mapping[k]: v for k, v in optim_state_dict["state"].items()},
                           "param_groups": copy.deepcopy(optim_state_dict["param_groups"])}
    for group in out["param_groups"]:
        group["params"] = sorted(mapping[k] for k in group["params"])
    return out


__all__ = ["OptimStateKeyType", "rekey_optim_state_dict"]
