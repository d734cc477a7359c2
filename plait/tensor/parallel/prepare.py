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
from plait.tensor.parallel.layouts import as_tuple, boundary
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

    def _converter(self, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None, what: str):
        if layout is None:
            return None
        return boundary(mesh, layout, desired, use_local_output=self.use_local_output, what=what, check_even=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(module).__name__
        positional = None if self.input_layouts is None else [
            self._converter(device_mesh, layout, desired, f"input {i} of {name}")
            for i, (layout, desired) in enumerate(zip(self.input_layouts, self.desired_input_layouts))]
        by_name = {key: self._converter(device_mesh, layout, self.desired_input_kwarg_layouts.get(key),
                                        f"kwarg {key!r} of {name}")
                   for key, layout in self.input_kwarg_layouts.items()}

        def prepare_inputs(inputs: tuple) -> tuple:
            if positional is None:
                return inputs
            if len(inputs) != len(positional):
                raise ValueError(f"{name} got {len(inputs)} positional inputs but PrepareModuleInput declares "
                                 f"{len(positional)} input_layouts {self.input_layouts}")
            return tuple(x if fn is None else fn(x) for x, fn in zip(inputs, positional))

        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda mod, args, kwargs: (prepare_inputs(args), {
                    k: v if by_name.get(k) is None else by_name[k](v) for k, v in kwargs.items()}),
                with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda mod, args: prepare_inputs(args))
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

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(module).__name__
        converters = [None if layout is None else boundary(
            device_mesh, layout, desired, use_local_output=self.use_local_output, what=f"output {i} of {name}",
            check_even=False) for i, (layout, desired) in enumerate(zip(self.output_layouts,
                                                                       self.desired_output_layouts))]

        def prepare_outputs(outputs):
            outs = outputs if isinstance(outputs, tuple) else (outputs,)
            if len(outs) != len(converters):
                raise ValueError(f"{name} returned {len(outs)} outputs but PrepareModuleOutput declares "
                                 f"{len(converters)} output_layouts {self.output_layouts}")
            prepared = tuple(x if fn is None else fn(x) for x, fn in zip(outs, converters))
            return prepared[0] if len(prepared) == 1 else prepared

        module.register_forward_hook(lambda mod, inputs, outputs: prepare_outputs(outputs))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
                f"{self.desired_output_layouts}, use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module (torch's style of that name);
    `use_local_input` is the input side's use_local_output."""

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None, use_local_input: bool = False,
                 output_layouts: Placement | Sequence[Placement | None],
                 desired_output_layouts: Placement | Sequence[Placement], use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input!r}, {self.prepare_module_output!r})"


__all__ = ["PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput"]
