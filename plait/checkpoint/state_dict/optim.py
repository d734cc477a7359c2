"""Optimizer state dicts keyed by parameter FQN, so state reshards with its parameter.

    get:  _init_optim_state (lazy state created by a zero-lr step) -> optim.state_dict()
          (state keyed 0..n-1 in param_groups order) -> ids renamed to canonical FQNs
          -> several optimizers merged -> [flatten] -> [full_state_dict: gathered] -> [cpu_offload]
    set:  [broadcast_from_rank0: rank 0's flattened state broadcast] -> [unflatten] -> for each
          optimizer: its params' FQNs picked from the state (strict: a param with requires_grad
          and no state is an error naming it) -> plain full tensors cut like the param
          -> ids -> optim.load_state_dict

A state tensor of a DTensor parameter is a DTensor like it (`exp_avg`); `step` stays as the
optimizer keeps it. FullyShardedDataParallel with use_orig_params=False steps flat parameters:
its own FSDP.optim_state_dict (SHARDED: split per FQN into DTensors) and
optim_state_dict_to_load (packed back) do the renaming for those, as torch's get_state_dict. Tied parameters are one parameter: their state is under the first FQN.
Flattened form (torch's): {"state.{fqn}.{key}": v, "param_groups.{fqn}.{key}": v}.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

from plait.checkpoint.state_dict.fqn import canonical_fqn, param_fqns
from plait.checkpoint.state_dict.full import (
    broadcast_flat,
    gather_full,
    keeps_full_state,
    offload,
    to_local_layout,
)
from plait.checkpoint.state_dict.model import raise_key_problems
from plait.checkpoint.state_dict.options import StateDictKeyError, StateDictOptions
from plait.tensor import DTensor

STATE, PG, PARAMS = "state", "param_groups", "params"


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazy state (Adam's exp_avg...) by one step with zero grads and lr 0,
    as torch's helper of this name does; a no-op when it has state or any grad is set."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g[PARAMS]]
    if any(p.grad is not None for p in params):
        return  # a step would use those grads: leave the (stateless or fresh) optimizer alone
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for g in optim.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optim.step(closure=None)
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def as_optimizers(optimizers: Any) -> tuple[torch.optim.Optimizer, ...]:
    optims = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    for o in optims:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizers must be a torch.optim.Optimizer or an iterable of them, "
                            f"got {type(o).__name__}")
    return optims


def _fqn_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict[torch.Tensor, list[str]]:
    fqns = param_fqns(model)
    for i, g in enumerate(optim.param_groups):
        for p in g[PARAMS]:
            if p not in fqns:
                raise ValueError(f"{type(optim).__name__} param_groups[{i}] holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not a parameter of {type(model).__name__}: "
                                 "pass the model the optimizer was built on")
    return fqns


def _flat_fsdp1(model: nn.Module) -> Any:
    """FullyShardedDataParallel when `model` holds a unit with a flat parameter, else None."""
    from plait.fsdp.fully_shard import _states

    if not any(s.group is not None and s.group.flat_param is not None for s in _states(model, True)):
        return None
    from plait.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _flat_get(fsdp: Any, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from plait.checkpoint.state_dict.model import sharded_fsdp1

    with sharded_fsdp1(model):
        osd = fsdp.optim_state_dict(model, optim)
    # FSDP's order is its units' (the flat parameters'); this module's is the model's own
    # parameter order, as for every other layout
    order: dict[str, int] = {}
    for path, m in nn.Module.named_modules(model):
        for key in m._parameters:  # (None too: a flattened parameter's name holds None)
            order.setdefault(canonical_fqn(model, f"{path}.{key}" if path else key), len(order))
    first = sorted(osd[STATE], key=lambda f: order.get(f, len(order)))
    return {STATE: {fqn: dict(osd[STATE][fqn]) for fqn in first},
            PG: [{**g, PARAMS: sorted(g[PARAMS], key=lambda f: order.get(f, len(order)))} for g in osd[PG]]}


def _flat_set(fsdp: Any, model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Load `optim`'s part of a merged FQN-keyed state (nested or flattened) through FSDP's
    optim_state_dict_to_load, which packs each flat parameter's state back."""
    from plait.fsdp.fsdp1.optim_state import _param_fqns

    names, _ = _param_fqns(model, optim)
    mine = [fqn for fqns in names for fqn in fqns]
    known = set(mine)
    if STATE in osd:
        state = {fqn: v for fqn, v in osd[STATE].items() if fqn in known}
        groups = [g for g in osd[PG] if set(g[PARAMS]) & known]
    else:  # flattened: {"state.{fqn}.{key}": v, "param_groups.{fqn}.{key}": v}
        state, values = {}, {}
        for key, value in osd.items():
            section, _, rest = key.partition(".")
            fqn = max(_prefixes_of(rest, known), key=len, default=None)
            if fqn is None:
                continue
            if section == STATE:
                state.setdefault(fqn, {})[rest[len(fqn) + 1:]] = value
            elif section == PG:
                values.setdefault(fqn, {})[rest[len(fqn) + 1:]] = value
        groups, pos = [], 0
        for g in optim.param_groups:
            fqns = [f for group_names in names[pos:pos + len(g[PARAMS])] for f in group_names]
            pos += len(g[PARAMS])
            groups.append({**{k: v for k, v in g.items() if k != PARAMS}, **values.get(fqns[0], {}), PARAMS: fqns})
    optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim, {STATE: state, PG: groups}))


@torch.no_grad()
def get_optim_state(model: nn.Module, optims: tuple[torch.optim.Optimizer, ...],
                    options: StateDictOptions) -> dict[str, Any]:
    merged: dict[str, Any] = {STATE: {}, PG: []}
    fsdp = _flat_fsdp1(model)
    for optim in optims:
        _init_optim_state(optim)
        if fsdp is not None:
            osd = _flat_get(fsdp, model, optim)
            merged[STATE].update(osd[STATE])
            merged[PG].extend(osd[PG])
            continue
        fqns = _fqn_of(model, optim)
        ordered = list(chain.from_iterable(g[PARAMS] for g in optim.param_groups))
        osd = optim.state_dict()
        for pid, state in osd[STATE].items():
            merged[STATE][fqns[ordered[pid]][0]] = dict(state)  # a copy: never alias optim.state's dicts
        for group in osd[PG]:
            merged[PG].append({**group, PARAMS: [fqns[ordered[pid]][0] for pid in group[PARAMS]]})
    state: dict[str, Any] = flatten(merged) if options.flatten_optimizer_state_dict else merged
    if options.full_state_dict:
        state = gather_full(state, cpu_offload=options.cpu_offload)
        return state if keeps_full_state(options.cpu_offload) else {}
    return offload(state) if options.cpu_offload else state


def flatten(osd: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def nested(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                nested(f"{prefix}.{k}", v)
        elif isinstance(value, (torch.Tensor, int, float)):
            flat[prefix] = value
        else:
            raise NotImplementedError(f"flatten_optimizer_state_dict: {prefix!r} is a {type(value).__name__}; "
                                      "optimizer state may hold tensors, ints, floats and dicts of them")

    for fqn, state in osd[STATE].items():
        nested(f"{STATE}.{fqn}", state)
    for group in osd[PG]:
        for fqn in group[PARAMS]:
            for k, v in group.items():
                if k != PARAMS:
                    flat[f"{PG}.{fqn}.{k}"] = v
    return flat


def _unflatten(optim: torch.optim.Optimizer, fqns: dict[torch.Tensor, list[str]],
               flat: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The nested {state, param_groups} of `optim`'s own parameters, from a flat state."""
    known = {n for names in fqns.values() for n in names}
    by_fqn: dict[str, dict[str, Any]] = {}  # one pass over the keys: fqn -> its state and group entries
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        fqn = max(_prefixes_of(rest, known), key=len, default=None)
        if fqn is not None and section in (STATE, PG):
            by_fqn.setdefault(fqn, {})[f"{section}.{rest[len(fqn) + 1:]}"] = value
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for i, g in enumerate(optim.param_groups):
        group: dict[str, Any] = {PARAMS: []}
        for p in g[PARAMS]:
            fqn = next((n for n in fqns[p] if n in by_fqn), fqns[p][0])
            mine = by_fqn.get(fqn, {})
            group[PARAMS].append(fqn)
            entry: dict[str, Any] = {}
            for key, value in mine.items():
                if key.startswith(STATE + "."):
                    *path, last = key[len(STATE) + 1:].split(".")
                    node = entry
                    for part in path:
                        node = node.setdefault(part, {})
                    node[last] = value
            if entry:
                state[fqn] = entry
            for k in g:
                if k == PARAMS:
                    continue
                if f"{PG}.{k}" not in mine:
                    if strict:
                        raise StateDictKeyError(f"set_optimizer_state_dict: missing key '{PG}.{fqn}.{k}' "
                                                f"(param_groups[{i}] of {type(optim).__name__})")
                    continue
                value = mine[f"{PG}.{k}"]
                if k in group and group[k] != value:
                    raise ValueError(f"set_optimizer_state_dict: param_groups[{i}] has {k}={group[k]!r} "
                                     f"for one parameter and {value!r} for {fqn!r}; one group holds one value")
                group[k] = value
        groups.append(group)
    return {STATE: state, PG: groups}


def _like_param(value: Any, p: torch.Tensor, full: bool) -> Any:
    """A plain state tensor shaped like DTensor parameter `p` (from a full state) becomes `p`'s piece
    of it; anything else (step, factored states, already-sharded values) stays as given, copied
    when the state is a full one: optim.load_state_dict keeps the tensors it is given and steps
    them in place (`step += 1`), which must not reach the caller's full state."""
    if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
            and tuple(value.shape) == tuple(p.shape) and value.dim() > 0:
        return to_local_layout("", value, p)
    return value.clone() if full and isinstance(value, torch.Tensor) else value


def _for_optim(optim: torch.optim.Optimizer, fqns: dict[torch.Tensor, list[str]], osd: dict[str, Any],
               strict: bool, full: bool) -> tuple[dict[str, Any], list[str]]:
    """`optim`'s part of a merged FQN-keyed state, in its own param-id form; the missing FQNs."""
    loaded_groups = {fqn: group for group in osd[PG] for fqn in group[PARAMS]}
    ordered = list(chain.from_iterable(g[PARAMS] for g in optim.param_groups))
    state, groups, missing = {}, [], []
    pid = 0
    for i, g in enumerate(optim.param_groups):
        ids, source = [], None
        for p in g[PARAMS]:
            assert ordered[pid] is p
            fqn = next((n for n in fqns[p] if n in loaded_groups or n in osd[STATE]), fqns[p][0])
            if fqn in osd[STATE]:
                state[pid] = {k: _like_param(v, p, full) for k, v in osd[STATE][fqn].items()}
            elif p.requires_grad and optim.state.get(p):  # it keeps state for p (SGD without
                missing.append(fqn)                         # momentum keeps none): the saved one lacks it
            source = source or loaded_groups.get(fqn)
            ids.append(pid)
            pid += 1
        if source is None:
            if strict and g[PARAMS]:
                raise StateDictKeyError(f"set_optimizer_state_dict: no saved param group holds "
                                        f"{[fqns[p][0] for p in g[PARAMS]]} (param_groups[{i}] of "
                                        f"{type(optim).__name__})")
            source = g
        groups.append({**{k: v for k, v in source.items() if k != PARAMS}, PARAMS: ids})
    return {STATE: state, PG: groups}, missing


@torch.no_grad()
def set_optim_state(model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], osd: dict[str, Any],
                    options: StateDictOptions) -> None:
    if not isinstance(osd, dict):
        raise TypeError(f"optim_state_dict must be a dict, got {type(osd).__name__}")
    fsdp = _flat_fsdp1(model)
    per_optim = [(optim, None if fsdp is not None else _fqn_of(model, optim)) for optim in optims]
    if options.broadcast_from_rank0:
        if fsdp is not None:
            from plait.fsdp.fsdp1.optim_state import _param_fqns

            mine = {n for optim in optims for names in _param_fqns(model, optim)[0] for n in names}
        else:
            mine = {n for _, fqns in per_optim for names in fqns.values() for n in names}

        def wanted(key: str) -> bool:
            return bool(_prefixes_of(key.partition(".")[2], mine))

        flat = flatten(osd) if osd and STATE in osd else osd
        osd = broadcast_flat(flat or None, device=_param_device(optims), wanted=wanted, check=lambda keys: None)
    if not osd:
        return
    for optim, fqns in per_optim:
        _init_optim_state(optim)
        if fsdp is not None:
            _flat_set(fsdp, model, optim, osd)
            continue
        nested = osd if STATE in osd else _unflatten(optim, fqns, osd, options.strict)
        own, missing = _for_optim(optim, fqns, nested, options.strict, options.full_state_dict)
        if missing and options.strict:
            raise_key_problems([f"{STATE}.{m}" for m in missing], [], "set_optimizer_state_dict")
        optim.load_state_dict(own)


def _prefixes_of(key_rest: str, fqns: set[str]) -> list[str]:
    """The FQNs `key_rest` ("{fqn}.{key}...") could start with (FQNs contain dots themselves)."""
    parts = key_rest.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in fqns]


def _param_device(optims: tuple[torch.optim.Optimizer, ...]) -> torch.device:
    for o in optims:
        for g in o.param_groups:
            for p in g[PARAMS]:
                if p.device.type != "meta":
                    return p.device
    return torch.device("cpu")
