"""StateDictOptions (torch's dataclass, same fields and defaults) and the key errors.

A key error is both a RuntimeError (what torch's get/set_state_dict raise for a missing key) and a
ValueError (plait's convention for a user's bad input), so either `except` catches it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StateDictOptions:
    """How get_state_dict / set_state_dict work (torch.distributed.checkpoint.state_dict's).

    - full_state_dict: gather every DTensor to a plain full tensor (get), or take plain full
      tensors and keep each rank's piece of them (set).
    - cpu_offload: move tensors to CPU; with full_state_dict only global rank 0 keeps the
      state, every other rank gets an empty dict (so no rank but one holds a full copy).
    - ignore_frozen_params: leave parameters with requires_grad=False out.
    - keep_submodule_prefixes: with `submodules`, keep the submodule's prefix on the keys.
    - strict: missing or unexpected keys are errors (set); with False they are returned.
    - broadcast_from_rank0: rank 0 holds a full state; it is broadcast and each rank keeps
      its own piece (every other rank may pass an empty dict).
    - flatten_optimizer_state_dict: the optimizer state as one flat dict
      `state.{fqn}.{key}` / `param_groups.{fqn}.{key}` (what pipeline stages merge).
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"  # torch's field; plait has no such modules


class StateDictKeyError(RuntimeError, ValueError):
    """A key the model or optimizer needs is missing from the state, or one it has no place for."""


def check_options(options: StateDictOptions | None) -> StateDictOptions:
    options = StateDictOptions() if options is None else options
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a StateDictOptions, got {type(options).__name__}")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("StateDictOptions(broadcast_from_rank0=True) needs full_state_dict=True: "
                         "rank 0's state is a full one")
    return options
