"""One pipeline stage on one rank: its module, what it received, what it owes its neighbours.

    RECV_F -> inputs[mb] (buffers) -> F: submod(*inputs) -> outputs -> SEND_F (detached copies)
    RECV_B -> grads[mb] (buffers)  -> B | I (+ W later) -> input_grads[mb] -> SEND_B

The stage computes and keeps per-microbatch state; the runtime (`runtime.py`) decides when,
posts the p2p ops the stage builds, and waits on a receive before the compute that reads it.

Invariants:
- Shapes are learnt once: `inputs_meta` / `outputs_meta` are None until the first step
  (see `meta.py`), then fixed; every later send is checked against them before it leaves,
  so a mismatch is an error naming stage, microbatch and both shapes, never a hang or garbage.
- A received activation is a fresh leaf (requires grad iff its dtype is differentiable);
  the graph a stage holds for a microbatch starts there and ends at its outputs (or loss).
- Inputs and grads are aligned with the boundary's tensors; a non-differentiable position
  holds None and is neither sent nor received in backward. An input grad that autograd
  leaves as None (input unused) is sent as zeros: the peer has posted that receive.
- After a step every per-microbatch dict is empty (checked): nothing leaks between steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten, tree_map

from plait import comm

from .backward import WeightGradState, backward_input, backward_weight, full_backward
from .data_parallel import grad_sync_for
from .meta import TensorMeta, check_same
from .schedules import loop_stage_to_rank


def _as_tuple(output: Any, stage: int) -> tuple[torch.Tensor, ...]:
    flat = (output,) if isinstance(output, torch.Tensor) else output
    if not isinstance(flat, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in flat):
        raise TypeError(
            f"stage {stage}'s forward returned {type(output).__name__}: a stage that feeds "
            "another must return a tensor or a tuple of tensors"
        )
    return tuple(flat)


def _metas(values: Any) -> tuple[TensorMeta, ...] | None:
    if values is None:
        return None
    flat = (values,) if isinstance(values, torch.Tensor) else tuple(values)
    return tuple(TensorMeta.of(t) for t in flat if isinstance(t, torch.Tensor))


class PipelineStage:
    """Stage `stage_index` of `num_stages`, running `submodule` on this rank (torch's class).

    `input_args` / `output_args`: optional example microbatch inputs / outputs. Shapes are
    inferred at the first step without them; when given, the inferred shapes are checked
    against them. `group`: the pipeline's process group (default: the world), whose ranks
    the schedule maps stages onto; keyword-only, because torch's 7th and 8th positional
    arguments are `output_grads` and `input_grads` (DTensor metadata, not needed here).
    `device`: where receive buffers are allocated (the submodule is not moved). The
    submodule may be data parallel (plait's DDP or `replicate` on a dp axis): its grads are
    then averaged over its group once per step, after the stage's last microbatch; or
    `fully_shard`-ed (plait.fsdp): one all-gather and one reduce-scatter per FSDP group per
    step (fully_sharded.py).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        *,
        group: ProcessGroup | None = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is not in [0, num_stages {num_stages})")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group if group is not None else comm.world_group()
        self.group_rank = comm.get_rank(self.group)
        self.group_size = comm.get_world_size(self.group)
        # The schedule replaces this with its own placement (V style for ZBV).
        self.stage_index_to_group_rank = loop_stage_to_rank(self.group_size, num_stages)
        self.has_backward = True
        # A data-parallel submodule (DDP, replicate, fully_shard) reduces its grads once per step, after
        # this stage's last backward (see data_parallel.py); None: nothing to reduce.
        self.grad_sync = grad_sync_for(submodule)
        self._user_inputs_meta = _metas(input_args)
        self._user_outputs_meta = _metas(output_args)
        self.inputs_meta: tuple[TensorMeta, ...] | None = None
        self.outputs_meta: tuple[TensorMeta, ...] | None = None
        self.clear_runtime_states()

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, rank {self.group_rank})"

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.submod.parameters() if p.requires_grad]

    def rank_of(self, stage: int) -> int:
        """The group rank that runs `stage` (as the schedule placed it)."""
        return self.stage_index_to_group_rank[stage]

    def clear_runtime_states(self) -> None:
        """Drop every per-microbatch buffer (the runtime calls this before each step)."""
        self._inputs: dict[int, list[torch.Tensor]] = {}  # received or handed-over activations
        self._fwd: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], tuple]] = {}
        self._to_send: dict[int, tuple[torch.Tensor, ...]] = {}
        self._grads: dict[int, list[torch.Tensor | None]] = {}  # grads of our outputs
        self._input_grads: dict[int, list[torch.Tensor | None]] = {}
        self._weight_state: dict[int, WeightGradState] = {}
        self.output_chunks: dict[int, Any] = {}

    def assert_drained(self) -> None:
        left = {
            name: sorted(d)
            for name, d in (
                ("inputs", self._inputs),
                ("forward", self._fwd),
                ("sends", self._to_send),
                ("grads", self._grads),
                ("input grads", self._input_grads),
                ("weight grads", self._weight_state),
            )
            if d
        }
        assert not left, f"stage {self.stage_index} ended the step holding {left}"

    # --- shapes ----------------------------------------------------------------------------

    def set_inputs_meta(self, metas: tuple[TensorMeta, ...]) -> None:
        """Learn the input shapes (first step); checked against `input_args` if given."""
        if self._user_inputs_meta is not None:
            check_same(
                metas,
                self._user_inputs_meta,
                f"stage {self.stage_index}: input_args tensor",
                "the microbatches it receives",
            )
        self.inputs_meta = metas

    def _check_outputs(self, mb: int, outputs: tuple[torch.Tensor, ...]) -> None:
        known = self.outputs_meta
        if known is not None and len(known) == len(outputs) and all(
            t.dtype == m.dtype and t.shape == m.shape for t, m in zip(outputs, known)
        ):
            return  # every microbatch after the first: the same shapes, checked cheaply
        got = tuple(TensorMeta.of(t) for t in outputs)
        if self.outputs_meta is None:
            if self._user_outputs_meta is not None:
                check_same(
                    got,
                    self._user_outputs_meta,
                    f"stage {self.stage_index}: output_args tensor",
                    "its forward",
                )
            self.outputs_meta = got
        elif not self.is_last:
            check_same(
                self.outputs_meta,
                got,
                f"stage {self.stage_index}, microbatch {mb}: output",
                "the first step (receive buffers are sized from it)",
            )

    # --- forward ---------------------------------------------------------------------------

    def set_local_input(self, mb: int, tensors: tuple[torch.Tensor, ...]) -> None:
        """Hand over the previous stage's output on this rank (V turn-around): no p2p."""
        self._inputs[mb] = list(tensors)

    def forward_one_chunk(self, mb: int, args: tuple = (), kwargs: dict | None = None) -> Any:
        """F: run the submodule on microbatch `mb`; return its output (torch's method)."""
        kwargs = kwargs or {}
        if self.is_first:
            inputs = args
            got = _metas(args)
            if self.inputs_meta is None:
                self.set_inputs_meta(got)
            else:
                check_same(
                    self.inputs_meta,
                    got,
                    f"stage 0, microbatch {mb}: input",
                    "the first step's microbatches",
                )
            leaves: list[torch.Tensor] = []
        else:
            received = self._inputs.pop(mb)
            leaves = [
                t.detach().requires_grad_(self.has_backward and m.differentiable)
                for t, m in zip(received, self.inputs_meta)
            ]
            inputs = tuple(leaves)
        with torch.set_grad_enabled(self.has_backward):
            output = self.submod(*inputs, **kwargs)
        last = self.is_last
        outputs = _as_tuple(output, self.stage_index) if not last else ()
        if not last or self.outputs_meta is None:  # the last stage's are recorded once
            self._check_outputs(mb, outputs if not last else _last_tensors(output))
        if last:
            self.output_chunks[mb] = (
                output.detach()
                if isinstance(output, torch.Tensor)
                else tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)
            )
        else:
            self._to_send[mb] = tuple(t.detach() for t in outputs)
        if self.has_backward:
            user = [
                t
                for t in _tensors(args if self.is_first else ()) + _tensors(kwargs)
                if t.requires_grad
            ]
            self._fwd[mb] = (leaves, user, outputs)
        return output

    def take_outputs(self, mb: int) -> tuple[torch.Tensor, ...]:
        return self._to_send.pop(mb)

    # --- backward --------------------------------------------------------------------------

    def set_local_grads(self, mb: int, grads: list[torch.Tensor | None]) -> None:
        """Hand over the next stage's input grads on this rank (V turn-around)."""
        self._grads[mb] = grads

    def backward_one_chunk(
        self, mb: int, loss: torch.Tensor | None = None, full_backward: bool = True
    ) -> None:
        """B (full_backward) or I (input grads only; `backward_weight_one_chunk` does W)."""
        leaves, user, outputs = self._fwd.pop(mb)
        if self.is_last:
            if loss is None:
                raise ValueError(f"stage {self.stage_index} is last: its backward needs the loss")
            roots, grads = [loss], [None]
        else:
            roots, grads = list(outputs), self._grads.pop(mb)
        inputs = leaves + user
        if full_backward:
            found = full_backward_fn(roots, grads, leaves)
            found += [None] * len(user)  # autograd.backward already reached the user's tensors
        else:
            found, self._weight_state[mb] = backward_input(roots, grads, inputs, self._params())
            pairs = [(t, g) for t, g in zip(user, found[len(leaves) :]) if g is not None]
            if pairs:  # carry on into the user's own graph (views of their batch)
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if not self.is_first:
            self._input_grads[mb] = [
                (g if g is not None else torch.zeros_like(x)) if m.differentiable else None
                for x, g, m in zip(leaves, found, self.inputs_meta)
            ]

    def backward_weight_one_chunk(self, mb: int) -> None:
        """W: the weight grads that I deferred."""
        if mb not in self._weight_state:
            raise RuntimeError(
                f"stage {self.stage_index}: W for microbatch {mb} has no I before it"
            )
        backward_weight(self._weight_state.pop(mb))

    def take_input_grads(self, mb: int) -> list[torch.Tensor | None]:
        return self._input_grads.pop(mb)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide this stage's param grads by `grad_scale_factor` (torch's method)."""
        if grad_scale_factor != 1:
            for p in self._params():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    # --- p2p ops (the runtime batches and posts them) --------------------------------------

    def fwd_recv_ops(self, mb: int) -> list[comm.P2POp]:
        bufs = [m.empty(self.device) for m in self.inputs_meta]
        self._inputs[mb] = bufs
        src = self.rank_of(self.stage_index - 1)
        return [comm.P2POp("recv", b, src, self.group) for b in bufs]

    def fwd_send_ops(self, mb: int) -> list[comm.P2POp]:
        dst = self.rank_of(self.stage_index + 1)
        return [comm.P2POp("send", t, dst, self.group) for t in self._to_send.pop(mb)]

    def bwd_recv_ops(self, mb: int) -> list[comm.P2POp]:
        bufs = [m.empty(self.device) if m.differentiable else None for m in self.outputs_meta]
        self._grads[mb] = bufs
        src = self.rank_of(self.stage_index + 1)
        return [comm.P2POp("recv", b, src, self.group) for b in bufs if b is not None]

    def bwd_send_ops(self, mb: int) -> list[comm.P2POp]:
        dst = self.rank_of(self.stage_index - 1)
        grads = self._input_grads.pop(mb)
        return [comm.P2POp("send", g.contiguous(), dst, self.group) for g in grads if g is not None]


full_backward_fn = full_backward  # the method argument `full_backward` shadows the function


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in `values` (a pytree); fast for the usual flat tuple or empty dict."""
    if not values:
        return []
    if isinstance(values, tuple) and all(isinstance(t, torch.Tensor) for t in values):
        return list(values)
    return [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]


def _last_tensors(output: Any) -> tuple[torch.Tensor, ...]:
    """The last stage's tensors, only to record `outputs_meta` (they are never sent)."""
    return tuple(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))


def build_stage(
    stage_module: nn.Module,
    stage_index: int,
    pipe_info: Any,
    device: torch.device | str,
    group: ProcessGroup | None = None,
) -> PipelineStage:
    """A PipelineStage for a `pipeline()`-traced stage module (torch's function).

        pipe = pipeline(model, mb_args=(x,), split_spec=spec)
        stage = build_stage(pipe.get_stage_module(i), i, pipe.info(), device, group)

    `pipe_info` is `Pipe.info()` (a `PipeInfo`): the stage count comes from it. As torch's
    does, the module is moved to `device` (a meta module is left where it is), so it may be
    wrapped (DDP, fully_shard) between `get_stage_module` and here.
    """
    num_stages = getattr(pipe_info, "num_stages", None)
    if not isinstance(num_stages, int):
        raise TypeError(
            f"build_stage(): pipe_info must be a PipeInfo (pipe.info()), got "
            f"{type(pipe_info).__name__}"
        )
    if not 0 <= stage_index < num_stages:
        raise ValueError(
            f"build_stage(): stage_index {stage_index} is not in [0, num_stages {num_stages})"
        )
    if not any(t.is_meta for t in stage_module.parameters()):
        stage_module.to(device)
    return PipelineStage(stage_module, stage_index, num_stages, device, group=group)
