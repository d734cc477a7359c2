"""One module's data-parallel state, shared by the DistributedDataParallel wrapper and the
composable `replicate`: what happens around each forward, and what a joined rank shadows.

    construct     verify shapes across ranks -> broadcast params + buffers from rank 0
                  -> Reducer (buckets, grad hooks)
    pre_forward   [join notice] -> rebuild buckets once -> broadcast buffers from rank 0
                  (if the previous forward synced) -> [join: tell joined ranks to sync]
    post_forward  synced: outputs watched for backward's start, reducer prepared
    joined rank   main_hook: rebuild, buffers, sync flag, zero buckets; post_hook: every
                  rank takes the model of the last rank to join

DTensor parameters and buffers (tensor parallel on other mesh axes) are checked,
broadcast and reduced as their local shards (shards.py).

`require_backward_grad_sync` (False under no_sync) decides whether the next backward
reduces; `require_forward_param_sync` remembers whether the last forward did, which is
when buffers are broadcast again (torch's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils import _pytree as pytree

from plait import comm
from plait.ddp import shards, sync
from plait.ddp.buckets import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MiB
from plait.ddp.compiled import BucketedCompile, not_traced
from plait.ddp.graph import watch_outputs
from plait.ddp.join import Join, Joinable, JoinHook
from plait.ddp.reducer import Phase, Reducer


def bucket_caps(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None) -> list[int]:
    """torch's rule: the first bucket is 1 MiB only when bucket_cap_mb is left at its
    default (25 MiB); an explicit cap applies to every bucket; a list gives each bucket
    its cap, the last one repeating."""
    if bucket_cap_mb_list:
        return [int(mb * MiB) for mb in bucket_cap_mb_list]
    if bucket_cap_mb is None:
        return [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MiB]
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return [int(bucket_cap_mb * MiB)]


class ReplicaState(Joinable):
    def __init__(self, module: nn.Module, *, group: ProcessGroup, ignored: set[str],
                 broadcast_buffers: bool, init_sync: bool, caps: Sequence[int],
                 find_unused_parameters: bool, gradient_as_bucket_view: bool, static_graph: bool,
                 device_ids: Sequence[int | torch.device] | None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.ignored = set(ignored)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        named = [(n, p) for n, p in module.named_parameters() if n not in self.ignored]
        trained = [(n, p) for n, p in named if p.requires_grad]
        if not trained:
            raise RuntimeError("DistributedDataParallel is not needed when a module has no "
                               "parameter that requires a gradient")
        _check_no_sparse(module)
        for name, p in trained:  # DTensors are reduced as local shards; other subclasses are unknown
            if type(p.data) not in (torch.Tensor, shards.DTensor):
                raise TypeError(f"parameter {name} is a {type(p.data).__name__}; data parallel takes plain "
                                "tensor parameters or DTensors (tensor parallel on other mesh axes)")
        buffers = self._named_buffers()
        self._has_buffers = bool(buffers)
        self._buffer_sync: sync.BufferBroadcast | None = None  # sync_buffers' plan, for these buffers
        shards.check_dtensor_params(named + buffers, group)
        device_types = {p.device.type for _, p in named}
        if len(device_types) != 1:
            raise ValueError(f"the module's parameters must be on one device type, got {sorted(device_types)}")
        self.device = trained[0][1].device
        self.device_ids = _check_device_ids(device_ids, self.device)
        if init_sync:
            states = named + (buffers if broadcast_buffers else [])
            states = [(n, shards.local(t)) for n, t in states]  # DTensors: their local shards
            sync.verify_shapes(states, group)
            sync.broadcast_coalesced([t for _, t in states], src=0, group=group)
        self.compile = BucketedCompile(caps)  # the module split at buckets, under torch.compile
        self.forward: Callable | None = None  # replicate: the module's own (class) forward
        self.reducer = Reducer(trained, group, caps=caps, find_unused_parameters=find_unused_parameters,
                               static_graph=static_graph, gradient_as_bucket_view=gradient_as_bucket_view)

    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        # looked up every time: a module may reassign its buffers (pytorch#63916)
        return [(n, b) for n, b in named_buffers(self.module) if n not in self.ignored]

    def _buffers(self) -> list[torch.Tensor]:
        """`_named_buffers()`' tensors; without names where none is ignored (every forward)."""
        if self.ignored:
            return [b for _, b in self._named_buffers()]
        return buffers_of(self.module)

    # -- around forward ---------------------------------------------------------------

    # Both run eager even when the forward is compiled: bookkeeping (hooks, handles, the
    # door's events) has nothing to give a graph, and traced it would break the graph.
    # `replicate` registers them as the module's hooks themselves (hence the signatures), and
    # dynamo skips them by a mark, not a wrapper: no wrapper frame per forward.
    @not_traced(recursive=True)
    def pre_forward(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Every forward: each step below is called only where it has work (its guard is the
        # first test it makes), so a plain step makes no frame that returns at once.
        grad_enabled = torch.is_grad_enabled()
        reducer = self.reducer
        sync_grads = grad_enabled and self.require_backward_grad_sync
        if not sync_grads or reducer._error is not None or reducer.phase is Phase.BACKWARD:
            reducer.prepare_for_forward(sync_grads)
        if self._join_config.enable:
            notice = Join.notify_join_context(self)
            if notice is not None:
                reducer.add_pending_work(notice, divisor=not self._divide_by_initial_world_size)
        if grad_enabled and reducer._rebuild_pending:
            reducer.rebuild_buckets()
        if self.require_forward_param_sync and self.broadcast_buffers and self._has_buffers:  # will_sync_module_buffers
            root = sync.find_common_rank(self.group, True) if self._join_config.enable else 0
            self.sync_buffers(root)
        if self._join_config.enable:  # tell joined ranks whether this backward reduces
            flag = torch.full((1,), float(self.require_backward_grad_sync), device=self.device)
            self.reducer.add_pending_work(comm.all_reduce(flag, group=self.group, async_op=True))
        if self.device_ids:
            device = torch.device(self.device.type, self.device_ids[0])
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), (args, kwargs))
        return args, kwargs

    @not_traced(recursive=True)
    def post_forward(self, _module: nn.Module, _args: tuple, output: Any) -> Any:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            reducer = self.reducer
            if type(output) is torch.Tensor and output.grad_fn is not None:  # watch_outputs' common case, inline
                output.grad_fn.register_prehook(reducer.begin_backward)
                reducer.prepare_for_backward([output])
            else:
                reducer.prepare_for_backward(watch_outputs(output, reducer.begin_backward))
        else:
            self.require_forward_param_sync = False
        return output

    def will_sync_module_buffers(self) -> bool:
        # torch's rule: whether the module had buffers when wrapped (sync_buffers looks them up again)
        return self.require_forward_param_sync and self.broadcast_buffers and self._has_buffers

    def sync_buffers(self, root: int) -> None:
        buffers = [shards.local(b) for b in self._buffers()]
        plan = self._buffer_sync
        if plan is None or not plan.matches(buffers):
            plan = self._buffer_sync = sync.BufferBroadcast(buffers, self.group)
        # a broadcast is not an autograd-visible change: keep saved-tensor version checks quiet
        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            plan.run(root)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        self.reducer.register_comm_hook(state, hook)

    # -- Joinable -----------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return _ReplicaJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.group


class _ReplicaJoinHook(JoinHook):
    def __init__(self, state: ReplicaState) -> None:
        self.state = state

    def main_hook(self) -> None:
        """One training rank's iteration, shadowed: the same collectives in the same order."""
        state = self.state
        state.reducer.rebuild_buckets()
        if state.will_sync_module_buffers():
            state.sync_buffers(sync.find_common_rank(state.group, False))
        flag = torch.zeros(1, device=state.device)
        comm.all_reduce(flag, group=state.group)
        should_sync = bool(flag.item())
        state.require_forward_param_sync = should_sync  # as a training rank's post_forward would
        if should_sync:
            state.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Everyone takes the model of the (highest) rank that joined last."""
        state = self.state
        root = sync.find_common_rank(state.group, is_last_joiner)
        tensors = [shards.local(p) for n, p in state.module.named_parameters() if n not in state.ignored]
        if state.broadcast_buffers:
            tensors += [shards.local(b) for _, b in state._named_buffers()]
        sync.broadcast_coalesced(tensors, src=root, group=state.group)


def named_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`module.named_buffers()` as a list, the same names in the same order (modules pre-order,
    each module and buffer once), walked with a stack: one Python call, not the ~5 per module
    of nn.Module's nested generators. Per forward (buffers are broadcast every step)."""
    out: list[tuple[str, torch.Tensor]] = []
    seen_modules: set[int] = set()  # ids: Module and Tensor hash in Python (a frame each)
    seen: set[int] = set()
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        for name, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append((prefix + name, b))
        children = []
        for name, child in m._modules.items():
            if child is not None:
                children.append((prefix + name + ".", child))
        stack.extend(reversed(children))
    return out


def buffers_of(module: nn.Module) -> list[torch.Tensor]:
    """`[b for _, b in named_buffers(module)]` without building the names: the same tensors in
    the same order (modules pre-order, each module and buffer once), a third of its time."""
    out: list[torch.Tensor] = []
    seen_modules: set[int] = set()
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        if m._buffers:
            for b in m._buffers.values():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    out.append(b)
        if m._modules:
            stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return out


def _check_no_sparse(module: nn.Module) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(f"{name or type(sub).__name__} has sparse=True; plait's DDP reduces dense "
                             "gradients only: construct it with sparse=False")


def _check_device_ids(device_ids: Sequence[int | torch.device] | None, device: torch.device) -> list[int] | None:
    if not device_ids:
        return None
    if len(device_ids) > 1:
        raise ValueError(f"device_ids can only be None or hold one device, got {list(device_ids)}")
    if device.type == "cpu":
        raise ValueError(f"device_ids {list(device_ids)} only apply to a module on an accelerator; "
                         "this module is on the CPU: pass device_ids=None")
    d = device_ids[0]
    return [d.index if isinstance(d, torch.device) else int(d)]
