"""The parallel styles that shard a module's weights: ColwiseParallel, RowwiseParallel,
SequenceParallel (torch's names, defaults and semantics).

    ColwiseParallel   nn.Linear    weight (out, in) Shard(0), bias Shard(0)
                      nn.Embedding weight (vocab, dim) Shard(1)
                      input  (input_layouts, default Replicate) -> Replicate
                      output Shard(-1) -> output_layouts (default Shard(-1)), to_local if use_local_output
    RowwiseParallel   nn.Linear    weight Shard(1), bias Replicate; input -> Shard(-1)
                      nn.Embedding weight Shard(0) (vocabulary rows); input -> Replicate
                      input  input_layouts (default Shard(-1))
                      output Partial -> output_layouts (default Replicate: an all-reduce;
                      Shard(1): a reduce-scatter, sequence parallel)
    SequenceParallel  any module (norms, dropout): parameters Replicate (from_local: each
                      rank's copy is taken as the value, no communication, as torch);
                      input -> Shard(sequence_dim); output stays a DTensor by default

Colwise then rowwise is Megatron's MLP: no communication between the two, one all-reduce
(or reduce-scatter) after. The collectives themselves come from the sharding rules; a
style only fixes the placements at the module's boundary (layouts.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from plait.device_mesh import DeviceMesh
from plait.tensor.api import distribute_module, distribute_tensor
from plait.tensor.dtensor import DTensor
from plait.tensor.parallel.layouts import boundary, local_output
from plait.tensor.placement import Placement, Replicate, Shard


class UnsupportedModuleError(TypeError, NotImplementedError):
    """A style applied to a module type it cannot shard (a TypeError; also the
    NotImplementedError torch raises, so torch-style handlers still catch it)."""


class ParallelStyle(ABC):
    """How parallelize_module changes one module: its parameters and its boundary."""

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...

    def _check_module(self, module: nn.Module, fqn: str) -> None:  # noqa: B027 - optional hook
        """Raise before anything is sent if this style cannot handle `module` (plait's own)."""


def _kind(style: ParallelStyle, module: nn.Module, fqn: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise UnsupportedModuleError(
        f"{type(style).__name__} shards nn.Linear and nn.Embedding, but {fqn or 'the module'!s} is a "
        f"{type(module).__name__}; use SequenceParallel, PrepareModuleInput/Output or a plan entry for its "
        "linear submodules instead")


def _shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None) -> None:
    """Replace each of the module's own parameters by a DTensor with its placement."""
    for name, param in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(param.detach(), mesh, [placements.get(name, Replicate())], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class _LinearStyle(ParallelStyle):
    """What colwise and rowwise share: one input in, one output out, through layouts."""

    input_layouts: tuple[Placement]
    output_layouts: tuple[Placement]
    desired_input_layouts: tuple[Placement]
    use_local_output: bool

    def _check_module(self, module: nn.Module, fqn: str) -> None:
        _kind(self, module, fqn)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = _kind(self, module, "")
        self.desired_input_layouts = self._desired_input(kind)
        placements = self._param_placements(kind)
        name = f"{type(self).__name__} {type(module).__name__}"
        to_input = boundary(device_mesh, self.input_layouts[0], self.desired_input_layouts[0],
                            use_local_output=False, async_op=True, what=f"the input of {name}")
        out = self.output_layouts[0]
        to_output = boundary(device_mesh, out, None, use_local_output=self.use_local_output, async_op=True,
                             what=f"the output of {name}", check_input=False)
        return distribute_module(
            module, device_mesh,
            lambda _, mod, mesh: _shard_params(mod, mesh, placements, self.src_data_rank) if mod is module else None,
            lambda mod, inputs, mesh: to_input(inputs[0]),
            lambda mod, outputs, mesh: to_output(outputs))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")


class ColwiseParallel(_LinearStyle):
    """Shard the output features (Linear) or the embedding dim (Embedding)."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _desired_input(self, kind: str) -> tuple[Placement]:
        return (Replicate(),)

    def _param_placements(self, kind: str) -> dict[str, Placement]:
        # Linear weight (out, in): rows are output features; bias (out,) alike
        return {"weight": Shard(0), "bias": Shard(0)} if kind == "linear" else {"weight": Shard(1)}


class RowwiseParallel(_LinearStyle):
    """Shard the input features (Linear) or the vocabulary rows (Embedding); the output is
    a Partial sum reduced to output_layouts."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.desired_input_layouts = (Shard(-1),)  # as torch: an Embedding's becomes Replicate at apply
        self.use_local_output = use_local_output

    def _desired_input(self, kind: str) -> tuple[Placement]:
        return (Shard(-1),) if kind == "linear" else (Replicate(),)

    def _param_placements(self, kind: str) -> dict[str, Placement]:
        # Linear weight (out, in): columns are input features; the bias is added once
        return {"weight": Shard(1), "bias": Replicate()} if kind == "linear" else {"weight": Shard(0)}


class SequenceParallel(ParallelStyle):
    """Run a norm or dropout on activations sharded along the sequence dim; its
    parameters are Replicate, and their gradients come out Partial (each rank's sum over
    its part of the sequence), reduced where they are next read (e.g. the optimizer)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _replicate_params(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            dt = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = f"SequenceParallel {type(module).__name__}"
        # as torch: a DTensor input is moved to the sequence sharding, whatever it is
        to_input = boundary(device_mesh, self.sequence_sharding[0], None, use_local_output=False, async_op=True,
                            what=f"the input of {name}", check_input=False)
        to_local = local_output(what=f"the output of {name}")
        return distribute_module(module, device_mesh, self._replicate_params,
                                 lambda mod, inputs, mesh: (to_input(inputs[0]), *inputs[1:]),
                                 lambda mod, out, mesh: to_local(out) if self.use_local_output and
                                 isinstance(out, DTensor) else out)

    def __repr__(self) -> str:
        return f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, use_local_output={self.use_local_output})"


_PREPARE = ("PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput")


def __getattr__(name: str):
    # torch's style module holds the PrepareModule* styles too; here they live in prepare.py,
    # which imports ParallelStyle from this module, so they are looked up on first use
    if name in _PREPARE:
        from plait.tensor.parallel import prepare

        return getattr(prepare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ColwiseParallel", "ParallelStyle", "RowwiseParallel", "SequenceParallel", "UnsupportedModuleError",
           *_PREPARE]
