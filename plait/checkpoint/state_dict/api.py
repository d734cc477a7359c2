"""torch.distributed.checkpoint.state_dict's public functions, by name, signature and meaning.

    model_sd, optim_sd = get_state_dict(model, optim)             # canonical FQNs, DTensor values
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)

`model` is the root a user holds (a DDP wrapper, a compiled module, an FSDP/TP/replicate'd
module, a pipeline stage's module); `optimizers` one optimizer or several over its parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from plait.checkpoint.state_dict.model import get_model_state, set_model_state
from plait.checkpoint.state_dict.optim import as_optimizers, get_optim_state, set_optim_state
from plait.checkpoint.state_dict.options import StateDictOptions, check_options

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def get_model_state_dict(model: nn.Module, *, submodules: set[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict under canonical FQNs (wrapper prefixes dropped)."""
    return get_model_state(model, check_options(options), submodules)


def get_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules: set[nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]} over all optimizers
    (or its flat form with flatten_optimizer_state_dict)."""
    return get_optim_state(model, as_optimizers(optimizers), check_options(options))


def get_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules: set[nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(get_model_state_dict(...), get_optimizer_state_dict(...))."""
    options = check_options(options)
    optims = as_optimizers(optimizers)
    return get_model_state(model, options, submodules), get_optim_state(model, optims, options)


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Load `model_state_dict` (canonical FQNs; sharded, or full, or rank 0's with
    broadcast_from_rank0) into the model's layout; returns the missing and unexpected keys."""
    return set_model_state(model, model_state_dict, check_options(options))


def set_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed optimizer state (nested or flat) into each optimizer's parameters."""
    set_optim_state(model, as_optimizers(optimizers), optim_state_dict, check_options(options))


def set_state_dict(model: nn.Module, optimizers: Optimizers, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """set_model_state_dict then set_optimizer_state_dict; returns the model's incompatible keys."""
    options = check_options(options)
    optims = as_optimizers(optimizers)
    keys = set_model_state(model, model_state_dict, options)
    set_optim_state(model, optims, optim_state_dict, options)
    return keys
