"""Split one model into pipeline stages: traced (`pipeline()`) or by module name (`split_model()`).

    pipeline():    model --trace the spine, cut at split points (trace.py)--> GraphModule per stage
    split_model(): model -> units (top-level children, containers expanded: "embed",
                   "layers.0", ..., "head") -> consecutive units per stage -> StageModule

`pipeline()` follows torch's: trace, cut the graph at the split points, one module per
stage; what the model computes between its children (skip connections, `layer(h, h)`,
keyword arguments, functional ops) is in the graph, and the stage chain is checked against
the model's own forward on the example before it is returned.

Both keep the original fqns (`layers.4.self_attn.in_proj_weight`), so a stage's state dict
reads like the model's and checkpoints load. `split_model` is the manual, torchtitan-style
split: the rank keeps the units of its own stages (any stages: interleaved and V schedules
give a rank several, non-adjacent ones) and every unit is removed from the original model,
so the memory of the other stages' parameters goes once the caller drops the model.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import fx, nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from .stage import PipelineStage, build_stage
from .trace import TraceError, build_stages, cut, example_values, trace_model

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


@dataclass(frozen=True)
class PipeInfo:
    """What a stage needs to know of its pipe (torch's dataclass; `Pipe.info()`).

    `graph`: the pipe's top-level graph, one `call_module` per stage (`submod_0`, ...) in
    order. `has_loss_and_backward`: always False, as `pipeline()` takes no loss function.
    It holds no reference to the stage modules, so dropping the pipe frees the others'."""

    graph: fx.Graph
    num_stages: int
    has_loss_and_backward: bool = False


def _chain_graph(stage_modules: Sequence[nn.Module]) -> fx.Graph:
    """inputs -> submod_0 -> submod_1 -> ... -> output; a tuple output is unpacked into the
    next stage's inputs (what `_verify` runs, and the runtime sends)."""

    def inputs(m: nn.Module) -> list[str]:
        if not hasattr(m, "graph"):  # a hand-built stage (StageModule): one input assumed
            return ["x"]
        return [n.target for n in m.graph.nodes if n.op == "placeholder" and "**" not in n.target]

    graph = fx.Graph()
    out: Any = tuple(graph.placeholder(name) for name in inputs(stage_modules[0]))
    for s, m in enumerate(stage_modules):
        if s:
            k = len(inputs(m))
            out = (
                (out,)
                if k == 1
                else tuple(graph.call_function(operator.getitem, (out, i)) for i in range(k))
            )
        out = graph.call_module(f"submod_{s}", out)
    graph.output(out)
    return graph


class Pipe:
    """What `pipeline()` returns: the stage modules, `info()`, and `build_stage` for this rank's.

    Like torch's Pipe it holds every stage (sharing the model's modules, not copies): keep
    the stages this rank builds and drop the pipe and the model to free the others.
    `split_gm`: a GraphModule whose children are the stages (`submod_0`, ...) and whose
    graph calls them in order. `module_names_per_stage[s]`: the fqns of the modules stage s
    calls, in call order."""

    def __init__(self, stage_modules: Sequence[nn.Module]) -> None:
        root = nn.Module()  # torch's attribute: children submod_0, submod_1, ...
        for s, module in enumerate(stage_modules):
            root.add_module(f"submod_{s}", module)
        self.split_gm = fx.GraphModule(root, _chain_graph(stage_modules), class_name="PipeSplit")
        self.module_names_per_stage = [
            list(dict.fromkeys(n.target for n in m.graph.nodes if n.op == "call_module"))
            if hasattr(m, "graph")
            else list(m.fqns)
            for m in stage_modules
        ]

    @property
    def num_stages(self) -> int:
        return len(self.module_names_per_stage)

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"stage_idx {stage_idx} is not in [0, {self.num_stages})")
        return self.split_gm.get_submodule(f"submod_{stage_idx}")

    def info(self) -> PipeInfo:
        """The pipe's graph and stage count, for the module-level `build_stage` (torch's)."""
        return PipeInfo(graph=self.split_gm.graph, num_stages=self.num_stages)

    def build_stage(
        self, stage_index: int, device: torch.device | str, group: ProcessGroup | None = None
    ) -> PipelineStage:
        """A PipelineStage running stage `stage_index`'s module, moved to `device`."""
        return build_stage(
            self.get_stage_module(stage_index), stage_index, self.info(), device, group
        )


def pipeline(
    module: nn.Module,
    mb_args: tuple[Any, ...],
    mb_kwargs: dict[str, Any] | None = None,
    split_spec: dict[str, SplitPoint] | None = None,
) -> Pipe:
    """Trace `module` on one example microbatch and cut it at `split_spec` (torch's function).

    `{"layers.4": SplitPoint.BEGINNING}` starts a stage at the first use of `layers.4` (any
    module fqn, nested ones too); `SplitPoint.END` ends one after its last use. See
    `trace.py` for what crosses a cut. Stage 0 takes the model's tensor arguments by name
    (`mb_args`, `mb_kwargs`); each later stage takes the previous one's outputs. A model the
    tracer cannot follow raises a ValueError naming the line, pointing to `split_model`.
    """
    mb_args = mb_args if isinstance(mb_args, tuple) else (mb_args,)
    mb_kwargs = dict(mb_kwargs or {})
    spec = dict(split_spec or {})
    modules = dict(module.named_modules())
    for fqn, point in spec.items():
        if fqn not in modules or fqn == "":
            near = [n for n in modules if n and n.split(".")[0] == fqn.split(".")[0]][:8]
            raise ValueError(
                f"split_spec names {fqn!r}, which is not a submodule of "
                f"{type(module).__name__}" + (f"; similar: {near}" if near else "")
            )
        if not isinstance(point, SplitPoint):
            raise TypeError(f"split_spec[{fqn!r}] must be a SplitPoint, got {point!r}")
    with _untouched(module):
        gm, inputs = trace_model(module, mb_args, mb_kwargs, list(spec))
        values = example_values(gm, inputs)
        stages = build_stages(gm, cut(gm, spec, values), values)
    pipe = Pipe(stages)
    _verify(module, pipe, mb_args, mb_kwargs)
    return pipe


@contextmanager
def _untouched(module: nn.Module):
    """Forward may update buffers (BatchNorm) and draw random numbers: undo both."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])


def _verify(module: nn.Module, pipe: Pipe, mb_args: tuple, mb_kwargs: dict) -> None:
    """Raise unless running the stages in order reproduces `module`'s forward exactly."""
    with torch.no_grad():
        with _untouched(module):
            expected = module(*mb_args, **mb_kwargs)
        with _untouched(module):
            try:
                got: Any = pipe.get_stage_module(0)(*mb_args, **mb_kwargs)
                for s in range(1, pipe.num_stages):
                    args = got if isinstance(got, tuple) else (got,)
                    got = pipe.get_stage_module(s)(*args, **mb_kwargs)
            except Exception as e:  # noqa: BLE001  (any failure means the split is wrong)
                raise TraceError(
                    f"pipeline(): the traced stages of {type(module).__name__} fail on mb_args "
                    f"({type(e).__name__}: {e}); split the model by hand with split_model"
                ) from e
    want, _ = tree_flatten(expected)
    have, _ = tree_flatten(got)
    same = len(want) == len(have) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        for a, b in zip(want, have)
    )
    if not same:
        raise TraceError(
            f"pipeline(): the traced stages of {type(module).__name__} "
            f"({pipe.module_names_per_stage}) do not reproduce its forward on mb_args (Python "
            "side effects or state the trace cannot see?); split the model by hand with "
            "split_model"
        )
