"""CommDebugMode: count the collectives (and bytes) that code inside a block issues.

    with CommDebugMode() as mode:
        loss = model(x).sum(); loss.backward()
    mode.get_total_counts()                 # 2
    mode.get_comm_counts()["all_reduce"]    # 1  (comm.all_reduce works as a key too)
    mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]     # 1: torch's keys work too

A listener on `plait.comm`: it sees exactly what passes the door, so whatever issued the
op — DTensor, a strategy, user code through plait.comm — is counted the same way.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from plait.comm import events

# torch's CommDebugMode keys its counts by op packet: the functional collectives
# (torch.ops.c10d_functional / _c10d_functional / _c10d_functional_autograd) and the c10d
# ops (torch.ops.c10d). Their names -> the plait.comm op that does the same.
_TORCH_NAMES = {
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_reduce_coalesced": "all_reduce", "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
}


def _op_name(key: Any) -> str:
    """Accept "all_reduce", the function plait.comm.all_reduce, or torch's op packet
    (torch.ops.c10d_functional.all_reduce, torch.ops.c10d.allreduce_) as a key."""
    if not isinstance(key, str):
        key = getattr(getattr(key, "_overloadpacket", key), "__name__", str(key))
    return _TORCH_NAMES.get(key, key)


class CommCounts(Counter):
    """A Counter keyed by op name that also accepts the plait.comm function as key."""

    def __getitem__(self, key: Any) -> int:
        return super().__getitem__(_op_name(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(_op_name(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(_op_name(key), default)


class _Modules(ModuleTracker):
    """torch's module tracker (`parents`, `is_bw`), silent while torch.compile traces: a
    compiled module's collectives count under "Global" only, as in torch's CommDebugMode.

    Its backward hooks go on non-leaf tensors only: torch's multi-grad hook on a leaf
    raises inside `torch.autograd.grad` ("A leaf node was passed to
    _will_engine_execute_node"), which is how a pipeline stage runs its backward (its input
    is a leaf cut from the previous stage). A module whose inputs are all leaves leaves the
    backward stack when the engine finishes, not when its input grads are computed."""

    def _fw_pre_hook(self, mod, input) -> None:  # noqa: A002 - torch's signature
        if torch.compiler.is_compiling():
            return
        name = self._get_mod_name(mod)
        self._get_append_fn(name, False)()
        tensors = _graph_tensors(input)
        if tensors:
            self._hooks.append(register_multi_grad_hook(tensors, self._get_pop_fn(name, True)))

    def _fw_post_hook(self, mod, input, output) -> None:  # noqa: A002 - torch's signature
        if torch.compiler.is_compiling():
            return
        name = self._get_mod_name(mod)
        self._get_pop_fn(name, False)()
        tensors = _graph_tensors(output)
        if tensors:
            self._hooks.append(register_multi_grad_hook(tensors, self._get_append_fn(name, True)))


def _graph_tensors(tree) -> list[torch.Tensor]:
    return [a for a in tree_flatten(tree)[0]
            if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is not None]


class CommDebugMode(events.CommListener):
    """Context manager counting collectives by op and bytes sent by this rank."""

    def __init__(self, *, track_modules: bool = True) -> None:
        # track_modules=False: no per-module view (comm_module_counts holds "Global" only) and
        # no hooks on module calls, which keep each module's inputs and outputs referenced
        # until backward (plait train counts every step's traffic this way)
        self._track_modules = track_modules
        self._lock = threading.Lock()
        self.comm_counts: CommCounts = CommCounts()
        self.comm_bytes: CommCounts = CommCounts()
        self.events: list[events.CommEvent] = []
        # torch's per-module view: module fqn ("Global" for everything, else the root module's
        # class name and the dotted path) -> {"forward": counts, "backward": counts}; an op
        # counts for its module and every module around it, as in torch
        self.comm_module_counts: dict[str, dict[str, CommCounts]] = {}
        self._modules: _Modules | None = None

    def on_start(self, event: events.CommEvent) -> None:
        with self._lock:
            self.comm_counts[event.op] += 1
            self.comm_bytes[event.op] += event.bytes_sent
            self.events.append(event)
            tracker = self._modules
            if tracker is not None:
                phase = "backward" if tracker.is_bw else "forward"
                for fqn in tracker.parents:
                    counts = self.comm_module_counts.get(fqn)
                    if counts is None:
                        counts = self.comm_module_counts[fqn] = {"forward": CommCounts(),
                                                                 "backward": CommCounts()}
                    counts[phase][event.op] += 1

    def get_total_counts(self) -> int:
        """Number of collective and p2p ops issued inside the block."""
        return sum(self.comm_counts.values())

    def get_comm_counts(self) -> CommCounts:
        """Op name -> number of calls."""
        return CommCounts(self.comm_counts)

    def get_comm_bytes(self) -> CommCounts:
        """Op name -> bytes this rank sent (per the implementation used)."""
        return CommCounts(self.comm_bytes)

    def get_total_bytes(self) -> int:
        return sum(self.comm_bytes.values())

    def __enter__(self) -> CommDebugMode:
        with self._lock:  # as torch's: each block counts afresh
            self.comm_counts.clear()
            self.comm_bytes.clear()
            self.events.clear()
            self.comm_module_counts.clear()
            self.comm_module_counts["Global"] = {"forward": CommCounts(), "backward": CommCounts()}
        if self._track_modules:
            self._modules = _Modules()
            self._modules.__enter__()
        events.add_listener(self)
        return self

    def __exit__(self, *exc: object) -> None:
        events.remove_listener(self)
        tracker, self._modules = self._modules, None
        if tracker is not None:
            tracker.__exit__(*exc)
