"""PrepareModuleInput and PrepareModuleOutput: placements at a module's boundary, with no
parameters touched (torch's names, defaults and semantics).

    PrepareModuleInput   forward pre-hook: input i with layout L_i (None: left alone)
                         -> DTensor laid out L_i -> redistributed to desired D_i -> to_local
                         if use_local_output (default False: the module gets DTensors);
                         kwargs alike by name, with input_kwarg_layouts
    PrepareModuleOutput  forward hook: output i with layout L_i -> desired D_i -> to_local
                         if use_local_output (default True)

Typical use (Megatron attention under sequence parallel): the block's input arrives
Shard(1) and is all-gathered once to Replicate, so wq, wk and wv share one gathered
DTensor, and in backward their three Partial gradients add up before the one
reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from plait.device_mesh import DeviceMesh
from plait.tensor.parallel.layouts import as_tuple, move, to_dtensor
from plait.tensor.parallel.style import ParallelStyle
from plait.tensor.placement import Placement

Layouts = Placement | Sequence[Placement | None] | None


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs (positional and keyword) to DTensors with the desired layouts."""

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = as_tuple(input_layouts, "input_layouts")
        self.desired_input_layouts = as_tuple(desired_input_layouts, "desired_input_layouts")
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise ValueError(f"PrepareModuleInput got input_layouts={self.input_layouts} but no "
                                 "desired_input_layouts; give one desired layout (or None) per input")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise ValueError(f"PrepareModuleInput: {len(self.input_layouts)} input_layouts "
                                 f"{self.input_layouts} but {len(self.desired_input_layouts)} "
                                 f"desired_input_layouts {self.desired_input_layouts}; give one per input")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if self.with_kwargs and set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(f"PrepareModuleInput: input_kwarg_layouts names {sorted(self.input_kwarg_layouts)} "
                             f"but desired_input_kwarg_layouts names {sorted(self.desired_input_kwarg_layouts)}; "
                             "name the same kwargs in both")

    def _prepare_arg(self, x, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None, what: str):
        if layout is None:
            return x
        dt = to_dtensor(x, mesh, layout, what=what)
        if desired is not None:
            dt = move(dt, desired)
        return dt.to_local() if self.use_local_output else dt

    def _prepare_inputs(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if self.input_layouts is None:
            return inputs
        if len(inputs) != len(self.input_layouts):
            raise ValueError(f"{type(module).__name__} got {len(inputs)} positional inputs but PrepareModuleInput "
                             f"declares {len(self.input_layouts)} input_layouts {self.input_layouts}")
        name = type(module).__name__
        return tuple(self._prepare_arg(x, mesh, layout, desired, f"input {i} of {name}")
                     for i, (x, layout, desired) in enumerate(zip(inputs, self.input_layouts,
                                                                  self.desired_input_layouts)))

    def _prepare_kwargs(self, module: nn.Module, kwargs: dict, mesh: DeviceMesh) -> dict:
        name = type(module).__name__
        return {key: self._prepare_arg(value, mesh, self.input_kwarg_layouts.get(key),
                                       self.desired_input_kwarg_layouts.get(key), f"kwarg {key!r} of {name}")
                for key, value in kwargs.items()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda mod, args, kwargs: (self._prepare_inputs(mod, args, device_mesh),
                                           self._prepare_kwargs(mod, kwargs, device_mesh)),
                with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda mod, args: self._prepare_inputs(mod, args, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
                f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs to DTensors with the desired layouts (then locals)."""

    def __init__(self, *, output_layouts: Placement | Sequence[Placement | None],
                 desired_output_layouts: Placement | Sequence[Placement], use_local_output: bool = True) -> None:
        self.output_layouts = as_tuple(output_layouts, "output_layouts")
        self.desired_output_layouts = as_tuple(desired_output_layouts, "desired_output_layouts")
        self.use_local_output = use_local_output
        if self.output_layouts is None or self.desired_output_layouts is None:
            raise ValueError("PrepareModuleOutput needs output_layouts and desired_output_layouts")
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(f"PrepareModuleOutput: {len(self.output_layouts)} output_layouts {self.output_layouts} "
                             f"but {len(self.desired_output_layouts)} desired_output_layouts "
                             f"{self.desired_output_layouts}; give one per output")

    def _prepare_outputs(self, module: nn.Module, outputs, mesh: DeviceMesh):
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        name = type(module).__name__
        if len(outs) != len(self.output_layouts):
            raise ValueError(f"{name} returned {len(outs)} outputs but PrepareModuleOutput declares "
                             f"{len(self.output_layouts)} output_layouts {self.output_layouts}")
        prepared = []
        for i, (out, layout, desired) in enumerate(zip(outs, self.output_layouts, self.desired_output_layouts)):
            if layout is None:
                prepared.append(out)
                continue
            dt = move(to_dtensor(out, mesh, layout, what=f"output {i} of {name}"), desired)
            prepared.append(dt.to_local() if self.use_local_output else dt)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, inputs, outputs: self._prepare_outputs(mod, outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
                f"{self.desired_output_layouts}, use_local_output={self.use_local_output})")


__all__ = ["PrepareModuleInput", "PrepareModuleOutput"]
