"""Split one model into pipeline stages by module name (fqn): `pipeline()` and `split_model()`.

    model -> units (top-level children, containers expanded: "embed", "layers.0", ..., "head")
          -> stages (consecutive units) -> StageModule per stage (units run in order, fqns kept)

What this split can represent, honestly: a model whose forward runs its units one after the
other, each taking the previous one's output (a tuple is unpacked into arguments). torch's
`pipeline()` traces the forward with torch.export and can split any traceable graph; this one
does not trace. Instead `pipeline()` runs the chain of units on the example microbatch and
compares with the model's own forward: if they differ (functional ops between children, skip
connections, kwargs), it raises instead of building a wrong pipeline.

A StageModule keeps the original fqns (`layers.4.attn.wq.weight`), so a stage's state dict
reads like the model's. `split_model` is the manual, torchtitan-style split: the rank keeps
the units of its own stages (any stages: interleaved and V schedules give a rank several,
non-adjacent ones) and every unit is removed from the original model, so the memory of the
other stages' parameters goes once the caller drops the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from .stage import PipelineStage

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class SplitPoint(Enum):
    """Where a stage boundary sits relative to the named unit (torch's enum)."""

    BEGINNING = 1
    END = 2


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's units in execution order: its top-level children, with a ModuleList,
    ModuleDict or Sequential child expanded into its entries (`layers.0`, `layers.1`, ...)."""
    found = []
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            found += [(f"{name}.{key}", sub) for key, sub in child.named_children()]
        else:
            found.append((name, child))
    return found


class StageModule(nn.Module):
    """Runs its units in order; a tuple output is unpacked into the next unit's arguments."""

    def __init__(self, named_units: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        if not named_units:
            raise ValueError("a stage needs at least one unit")
        self.fqns = [fqn for fqn, _ in named_units]
        for fqn, module in named_units:
            parent, _, key = fqn.rpartition(".")
            if parent:
                if parent not in self._modules:
                    self.add_module(parent, nn.ModuleDict())
                self._modules[parent].add_module(key, module)  # keeps "layers.4" as the fqn
            else:
                self.add_module(key, module)

    def forward(self, *args: Any) -> Any:
        out: Any = args
        for fqn in self.fqns:
            out = self.get_submodule(fqn)(*(out if isinstance(out, tuple) else (out,)))
        return out

    def extra_repr(self) -> str:
        return f"units={self.fqns}"


def _check_assignment(all_units: list[str], per_stage: Sequence[Sequence[str]]) -> None:
    known, seen = set(all_units), set()
    for s, stage in enumerate(per_stage):
        if not stage:
            raise ValueError(f"stage {s} has no units")
        for fqn in stage:
            if fqn not in known:
                raise ValueError(
                    f"stage {s}: {fqn!r} is not a unit of the model; units: {all_units}"
                )
            if fqn in seen:
                raise ValueError(f"unit {fqn!r} is in two stages")
            seen.add(fqn)
    missing = [fqn for fqn in all_units if fqn not in seen]
    if missing:
        raise ValueError(f"units {missing} are in no stage")
    flat = [fqn for stage in per_stage for fqn in stage]
    for i, (fqn, expected) in enumerate(zip(flat, all_units)):
        if fqn != expected:
            raise ValueError(
                f"stages must take the units in model order: position {i} is {fqn!r}, the "
                f"model has {expected!r} there"
            )


def split_evenly(model: nn.Module, num_stages: int) -> list[list[str]]:
    """Units per stage, consecutive and as equal in count as possible (earlier stages get the
    extra one): a starting point for `split_model`."""
    names = [fqn for fqn, _ in units(model)]
    if not 1 <= num_stages <= len(names):
        raise ValueError(f"cannot cut {len(names)} units into num_stages({num_stages}) stages")
    base, extra = divmod(len(names), num_stages)
    out, pos = [], 0
    for s in range(num_stages):
        size = base + (s < extra)
        out.append(names[pos : pos + size])
        pos += size
    return out


def split_model(
    model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    stage_indices: int | Sequence[int],
) -> list[StageModule]:
    """Manual split: the StageModules of `stage_indices`, built from `model`'s own units.

    `module_names_per_stage[s]` lists stage s's units (see `units`), all stages together
    covering every unit once, in order. The model is consumed: every unit is removed from
    it, and only the returned stages keep theirs.
    """
    named = units(model)
    _check_assignment([fqn for fqn, _ in named], module_names_per_stage)
    indices = [stage_indices] if isinstance(stage_indices, int) else list(stage_indices)
    for s in indices:
        if not 0 <= s < len(module_names_per_stage):
            raise ValueError(f"stage index {s} is not in [0, {len(module_names_per_stage)})")
    by_name = dict(named)
    stages = [
        StageModule([(fqn, by_name[fqn]) for fqn in module_names_per_stage[s]]) for s in indices
    ]
    for fqn, _ in named:  # others deleted: the model no longer references any unit
        parent, _, key = fqn.rpartition(".")
        (model.get_submodule(parent) if parent else model)._modules.pop(key)
    return stages


class Pipe:
    """What `pipeline()` returns: the stage modules, and `build_stage` for this rank's.

    Like torch's Pipe it holds every stage (sharing the model's modules, not copies): keep
    the stages this rank builds and drop the pipe and the model to free the others."""

    def __init__(self, module: nn.Module, module_names_per_stage: list[list[str]]) -> None:
        by_name = dict(units(module))
        self.module_names_per_stage = module_names_per_stage
        self.split_gm = nn.Module()  # torch's attribute: children submod_0, submod_1, ...
        for s, names in enumerate(module_names_per_stage):
            self.split_gm.add_module(f"submod_{s}", StageModule([(n, by_name[n]) for n in names]))

    @property
    def num_stages(self) -> int:
        return len(self.module_names_per_stage)

    def get_stage_module(self, stage_idx: int) -> StageModule:
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"stage_idx {stage_idx} is not in [0, {self.num_stages})")
        return self.split_gm.get_submodule(f"submod_{stage_idx}")

    def build_stage(
        self, stage_index: int, device: torch.device | str, group: ProcessGroup | None = None
    ) -> PipelineStage:
        """A PipelineStage running stage `stage_index`'s module, moved to `device`."""
        module = self.get_stage_module(stage_index).to(device)
        return PipelineStage(module, stage_index, self.num_stages, device, group=group)


def pipeline(
    module: nn.Module,
    mb_args: tuple[Any, ...],
    mb_kwargs: dict[str, Any] | None = None,
    split_spec: dict[str, SplitPoint] | None = None,
) -> Pipe:
    """Cut `module` into stages at the units `split_spec` names (torch's function).

    `{"layers.4": SplitPoint.BEGINNING}` starts a stage at `layers.4`; `SplitPoint.END` ends
    one after the named unit. `mb_args` is an example microbatch: the chain of units is run
    on it and must reproduce `module(*mb_args)` exactly (see the module note).
    """
    if mb_kwargs:
        raise ValueError(
            f"pipeline(): keyword inputs {sorted(mb_kwargs)} cannot be routed by the sequential "
            "split (only the first unit sees the inputs); use split_model and stage kwargs"
        )
    mb_args = mb_args if isinstance(mb_args, tuple) else (mb_args,)
    names = [fqn for fqn, _ in units(module)]
    cuts = set()
    for fqn, point in (split_spec or {}).items():
        if fqn not in names:
            raise ValueError(f"split_spec names {fqn!r}, which is not a unit; units: {names}")
        if not isinstance(point, SplitPoint):
            raise TypeError(f"split_spec[{fqn!r}] must be a SplitPoint, got {point!r}")
        k = names.index(fqn) + (point is SplitPoint.END)
        if 0 < k < len(names):
            cuts.add(k)
    bounds = [0, *sorted(cuts), len(names)]
    per_stage = [names[a:b] for a, b in zip(bounds, bounds[1:])]
    pipe = Pipe(module, per_stage)
    _verify(module, pipe, mb_args)
    return pipe


def _verify(module: nn.Module, pipe: Pipe, mb_args: tuple) -> None:
    """Raise unless running the stages in order reproduces `module`'s forward on mb_args."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    try:
        with torch.no_grad():
            with torch.random.fork_rng(devices=devices):
                expected = module(*mb_args)
            with torch.random.fork_rng(devices=devices):
                got: Any = mb_args
                for s in range(pipe.num_stages):
                    got = pipe.get_stage_module(s)(*(got if isinstance(got, tuple) else (got,)))
    finally:
        with torch.no_grad():  # forward may update buffers (BatchNorm): undo both runs
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
    want, _ = tree_flatten(expected)
    have, _ = tree_flatten(got)
    same = len(want) == len(have) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        for a, b in zip(want, have)
    )
    if not same:
        names = [n for stage in pipe.module_names_per_stage for n in stage]
        raise ValueError(
            f"pipeline(): running {type(module).__name__}'s units {names} "
            "in order does not reproduce its forward on mb_args, so this split (which does not "
            "trace) would compute something else; make forward a chain of its children, or "
            "split by hand with split_model"
        )
