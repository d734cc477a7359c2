"""use_orig_params=False (torch's default): one flat parameter per FullyShardedDataParallel
unit, torch's FlatParameter by name and meaning, on the engine's own (S,) layout.

    the unit's group: parameters i = 0..n-1, padded shard numels P_i, offsets off_i, S = sum P_i
    flat (S,) in the parameters' dtype on their shard device (CPU under CPU offload):
        param i's sharded local (local_rows_i, *rest_i) is the view flat[off_i : off_i + local_numel_i];
        the rest of its P_i block is padding, zero (its gradient is always zero there)
    registered: wrapped_module._parameters["_flat_param"] = nn.Parameter(flat) (the module the
        unit wrapped, kept as unit._flat_owner: activation checkpointing applied later puts a
        CheckpointWrapper between, as in torch's names), so that
        named_parameters() gives torch's names (`_fsdp_wrapped_module._flat_param`,
        `_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._flat_param`, ...); the original
        names hold no parameter (None) between steps, the unsharded parameters during forward
        and backward (the engine's), the sharded DTensors (views of flat) inside state_dict()
        and load_state_dict(), and the full tensors inside summon_full_params
    a step: all-gather input = flat itself (cast under mixed precision; no copy-in) -> ... ->
        the reduce-scatter's output (S,) becomes flat.grad (added to a kept one) -> the
        optimizer updates flat in place, and with it every view the state dicts read

Where plait differs from torch: torch's shard is a chunk of the concatenation (every
parameter flattened, concatenated, padded to a multiple of N, chunked); plait's is every
parameter's own chunk, padded, concatenated (the layout one all-gather and one
reduce-scatter use without a copy). Both have one numel on every rank, but not the same
numel as each other, and an element sits at another offset: the flat parameter, its .grad
and optim.state_dict() differ; everything keyed by FQN is the same (state dicts,
FSDP.optim_state_dict / optim_state_dict_to_load, summon_full_params, clip_grad_norm_).
Between steps torch's original attributes are views of freed memory, plait's are None.
rekey_optim_state_dict refuses such a model (its ids would index torch's layout);
LOCAL_STATE_DICT gives per-parameter local shards, as with use_orig_params=True.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.fsdp.group import ParamGroup
from plait.tensor import DTensor
from plait.tensor.spec import DTensorSpec

FLAT_PARAM = "_flat_param"


def flatten(wrapped: nn.Module, group: ParamGroup, where: str) -> nn.Parameter:
    """Move the group's sharded locals into one flat (S,) parameter registered on `wrapped`
    (each local now a view of it); the original names are left holding None."""
    params = group.params
    dtypes = sorted({str(p.orig_dtype) for p in params})
    if len(dtypes) > 1:
        raise ValueError(f"{where}: use_orig_params=False flattens the unit's parameters into one tensor, so they "
                         f"need one dtype, got {dtypes}; pass use_orig_params=True or wrap them apart")
    grads = {p.requires_grad for p in params}
    if len(grads) > 1:
        frozen = [p.fqn for p in params if not p.requires_grad]
        raise ValueError(f"{where}: use_orig_params=False needs every parameter of a unit to require grad, or "
                         f"none (torch's rule); {len(frozen)} of {len(params)} do not ({frozen[:4]}); pass "
                         "use_orig_params=True or wrap the frozen ones apart")
    odd = [p.fqn for p in params if not p.rows_first]
    if odd:
        raise ValueError(f"{where}: use_orig_params=False flattens plain parameters sharded on dim 0; {odd[:4]} "
                         "are tensor-parallel DTensors or sharded on another dim: pass use_orig_params=True")
    first = params[0].local
    flat = torch.zeros(group.total, dtype=first.dtype, device=first.device)  # (S,), padding zero
    if first.is_pinned():
        flat = flat.pin_memory()
    with torch.no_grad():
        for p, off in zip(params, group.offsets):
            view = flat[off:off + p.local_numel]
            view.copy_(p.local.reshape(-1))
            sharded = DTensor(view.view(p.local_rows, *p.rest), p.sharded._spec, requires_grad=False)
            p.sharded = nn.Parameter(sharded, requires_grad=p.requires_grad)
            assert p.local.data_ptr() == view.data_ptr() or p.local_numel == 0, p.fqn
            p.in_flat = True
            p.register(None)
    flat_param = nn.Parameter(flat, requires_grad=params[0].requires_grad)
    wrapped._parameters[FLAT_PARAM] = flat_param
    group.flat_param = flat_param
    return flat_param


def expose(unit: nn.Module) -> None:
    """The sharded DTensors under their original names, no flat parameter (state dicts)."""
    group = unit._state.group
    if group is None or group.flat_param is None:
        return
    for p in group.params:
        p.register(p.sharded)
    unit._flat_owner._parameters[FLAT_PARAM] = None


def hide(unit: nn.Module) -> None:
    """Back to the flat parameter, the original names holding None."""
    group = unit._state.group
    if group is None or group.flat_param is None:
        return
    for p in group.params:
        p.register(None)
    unit._flat_owner._parameters[FLAT_PARAM] = group.flat_param


def flat_members(model: nn.Module, clean: Any) -> dict[int, tuple[ParamGroup, list[tuple[str, Any, int]]]]:
    """id(flat parameter) -> (its group, [(FQN, FSDPParam, offset)]): the FQN a clean name of
    the parameter's first place, as optim_state_dict keys it."""
    from plait.fsdp.fully_shard import _states

    paths = {id(m): path for path, m in nn.Module.named_modules(model, remove_duplicate=False)}
    out = {}
    for s in _states(model, True):
        group = s.group
        if group is None or group.flat_param is None:
            continue
        items = []
        for p, off in zip(group.params, group.offsets):
            module, name = p.sites[0]
            path = paths[id(module)]
            items.append((clean(f"{path}.{name}" if path else name), p, off))
        out[id(group.flat_param)] = (group, items)
    return out


def piece(value: torch.Tensor, p: Any, off: int) -> DTensor:
    """Parameter p's part of a flat (S,) tensor (its .grad, an optimizer state) as a DTensor
    laid out as p's sharded parameter (a view, no copy)."""
    spec = p.sharded._spec
    if value.dtype != spec.dtype:
        spec = DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, value.dtype)
    return DTensor(value[off:off + p.local_numel].view(p.local_rows, *p.rest), spec, requires_grad=False)


def is_flat_state(value: Any, group: ParamGroup) -> bool:
    """An optimizer state tensor laid out as the flat parameter (exp_avg), not a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == group.total


__all__ = ["FLAT_PARAM", "expose", "flat_members", "flatten", "hide", "is_flat_state", "piece"]
