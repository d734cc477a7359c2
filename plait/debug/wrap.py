"""A script's own torch.distributed calls pass the same door: wrapped entry points.

    dist.all_reduce(t) -> wrapper -> the group's sequence counter += 1 -> CommEvent
       -> listeners' on_start (check, recorder, watchdog) -> torch's original function
       -> on_end when it completes (at once if synchronous, via the Work's future if not)

The numbering is plait's: a user's all_reduce and plait's own share the group's counter in
`plait.comm.group`, so a mismatch between them is caught like any other. plait's own ops
call the originals bound in `plait.comm._c10d`, and a thread-local depth keeps torch
functions that call each other (all_gather_into_tensor -> all_gather_single,
all_gather_object -> all_gather) to one event each, so nothing is seen twice.

Wrapped in `torch.distributed` and in `torch.distributed.distributed_c10d` (where torch's
object collectives look them up); isend/irecv/P2POp/batch_isend_irecv only in the former,
because c10d checks a P2POp's op by identity against its own isend and irecv.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from plait.comm import events
from plait.comm.group import group_info


@dataclass(frozen=True)
class Spec:
    op: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    reduce: str | None = None  # parameter holding the ReduceOp
    root: tuple[str, str] | None = None  # (global-rank parameter, group-rank parameter)
    p2p: str | None = None  # "send" or "recv"


_AG, _RS = Spec("all_gather", ("input_tensor",), ("output_tensor",)), Spec("reduce_scatter", ("input",), ("output",), "op")
SPECS: dict[str, Spec] = {
    "all_reduce": Spec("all_reduce", ("tensor",), ("tensor",), "op"),
    "all_gather": Spec("all_gather", ("tensor",), ("tensor_list",)),
    "all_gather_single": _AG, "all_gather_into_tensor": _AG,
    "reduce_scatter": Spec("reduce_scatter", ("input_list",), ("output",), "op"),
    "reduce_scatter_single": _RS, "reduce_scatter_tensor": _RS,
    "all_to_all": Spec("all_to_all", ("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": Spec("all_to_all", ("input",), ("output",)),
    "broadcast": Spec("broadcast", ("tensor",), ("tensor",), root=("src", "group_src")),
    "reduce": Spec("reduce", ("tensor",), ("tensor",), "op", root=("dst", "group_dst")),
    "gather": Spec("gather", ("tensor",), ("gather_list",), root=("dst", "group_dst")),
    "scatter": Spec("scatter", ("scatter_list",), ("tensor",), root=("src", "group_src")),
    "barrier": Spec("barrier"),
    "send": Spec("send", ("tensor",), (), root=("dst", "group_dst"), p2p="send"),
    "recv": Spec("recv", (), ("tensor",), root=("src", "group_src"), p2p="recv"),
    "isend": Spec("send", ("tensor",), (), root=("dst", "group_dst"), p2p="send"),
    "irecv": Spec("recv", (), ("tensor",), root=("src", "group_src"), p2p="recv"),
}
_PACKAGE_ONLY = frozenset({"isend", "irecv", "batch_isend_irecv", "P2POp"})

_depth = threading.local()
_saved: list[tuple[object, str, object]] = []  # (module, name, original) to restore


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _reduce_name(op: Any) -> str:
    name = getattr(op, "name", None) or str(op)
    name = str(name).rsplit(".", 1)[-1].lower()
    return {"prod": "product"}.get(name, name)


def _bytes_sent(op: str, n: int, nbytes: int, is_root: bool) -> int:
    share = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "reduce_scatter": (n - 1) / n,
             "all_to_all": (n - 1) / n, "send": 1, "recv": 0, "barrier": 0,
             "broadcast": 1 if is_root else 0, "reduce": 0 if is_root else 1,
             "gather": 0 if is_root else 1, "scatter": (n - 1) / n if is_root else 0}[op]
    return int(share * nbytes)


def _begin(spec: Spec, args: dict, group: Any, async_op: bool, peer: int | None) -> events.CommEvent:
    info = group_info(group)
    if spec.p2p:
        key = (spec.p2p, -1 if peer is None else peer)
        seq = info.p2p_seq[key] = info.p2p_seq.get(key, 0) + 1
    else:
        info.seq += 1
        seq = info.seq
    inputs = [t for name in spec.inputs for t in _tensors(args.get(name))]
    outputs = [t for name in spec.outputs for t in _tensors(args.get(name))]
    in_bytes = sum(t.numel() * t.element_size() for t in inputs)
    event = events.CommEvent(
        op=spec.op, group_name=info.name, group_ranks=info.ranks, rank=info.rank, seq=seq,
        input_shapes=tuple(tuple(t.shape) for t in inputs), input_dtypes=tuple(t.dtype for t in inputs),
        output_shapes=tuple(tuple(t.shape) for t in outputs), output_dtypes=tuple(t.dtype for t in outputs),
        bytes_sent=_bytes_sent(spec.op, info.size, in_bytes, peer == info.rank),
        reduce_op=_reduce_name(args[spec.reduce]) if spec.reduce else None,
        peer=peer, impl="torch.distributed", async_op=async_op,
    )
    events.emit_start(event)
    return event


def _peer(spec: Spec, args: dict, group: Any) -> int | None:
    if spec.root is None:
        return None
    global_name, group_name = spec.root
    if args.get(group_name) is not None:
        return int(args[group_name])
    if args.get(global_name) is None:
        return None
    return dist.get_group_rank(group, int(args[global_name]))


def _end(event: events.CommEvent) -> None:
    if event.end_ns is None:  # once, whoever sees the completion first
        event.work = None
        events.emit_end(event)


class _TracedWork:
    """A c10d Work whose completion is reported when it is waited on or seen completed:
    what a backend without Work futures (Gloo's send and recv) gets back instead."""

    __slots__ = ("_work", "_event")

    def __init__(self, work: Any, event: events.CommEvent) -> None:
        self._work, self._event = work, event

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        _end(self._event)
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            _end(self._event)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _finish(event: events.CommEvent, work: Any) -> Any:
    """Report the end of `event` — now for a synchronous op, at completion for a Work —
    and return what the caller gets back."""
    if work is None or not hasattr(work, "get_future"):
        _end(event)
        return work
    event.work = work  # the watchdog polls it, whether or not anybody waits
    try:
        future = work.get_future()
    except RuntimeError:  # "getFuture not implemented": report at wait()
        return _TracedWork(work, event)
    future.add_done_callback(lambda _: _end(event))
    return work


def _failed(event: events.CommEvent, error: BaseException) -> None:
    for listener in events._listeners:  # plait.debug's session included
        on_failed = getattr(listener, "on_failed", None)
        if on_failed is not None:
            on_failed(event, error)


def _traced(name: str, spec: Spec, original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_depth, "n", 0) or not events._listeners or not dist.is_initialized():
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # a wrong call: let torch say what is wrong with it
            return original(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        group = a.get("group") or c10d._get_default_group()
        if c10d._rank_not_in_group(group):
            return original(*args, **kwargs)
        async_op = bool(a.get("async_op", False)) or name in ("isend", "irecv")
        event = _begin(spec, a, group, async_op, _peer(spec, a, group))
        _depth.n = 1
        try:
            result = original(*args, **kwargs)
        except BaseException as e:
            _failed(event, e)
            raise
        finally:
            _depth.n = 0
        if not async_op:
            _finish(event, None)
            return result
        return _finish(event, result)

    wrapper.__plait_original__ = original
    return wrapper


def _traced_batch(original: Callable) -> Callable:
    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list: list) -> list:
        if getattr(_depth, "n", 0) or not events._listeners or not p2p_op_list:
            return original(p2p_op_list)
        started = []
        for op in p2p_op_list:
            kind = "send" if "send" in getattr(op.op, "__name__", "") else "recv"
            spec = SPECS["isend" if kind == "send" else "irecv"]
            args = {"tensor": op.tensor}
            started.append(_begin(spec, args, op.group or c10d._get_default_group(), True, op.group_peer))
        _depth.n = 1
        try:
            works = original(p2p_op_list)
        except BaseException as e:
            for event in started:
                _failed(event, e)
            raise
        finally:
            _depth.n = 0
        if len(works) != len(started):  # coalesced into one Work (NCCL): it ends them all
            for event in started:
                _finish(event, works[-1])
            return works
        return [_finish(event, work) for event, work in zip(started, works)]

    batch_isend_irecv.__plait_original__ = original
    return batch_isend_irecv


def _original(fn: Any) -> Any:
    return getattr(fn, "__plait_original__", fn)


class _P2POp(c10d.P2POp):
    """torch's P2POp, accepting the wrapped isend/irecv (c10d checks the op by identity)."""

    def __new__(cls, op: Callable, *args: Any, **kwargs: Any):
        return super().__new__(cls, _original(op), *args, **kwargs)

    def __init__(self, op: Callable, *args: Any, **kwargs: Any) -> None:
        super().__init__(_original(op), *args, **kwargs)


_P2POp.__name__ = _P2POp.__qualname__ = "P2POp"


def installed() -> bool:
    return bool(_saved)


def install() -> None:
    """Wrap torch.distributed's collective and p2p entry points (idempotent)."""
    if _saved:
        return
    for name, spec in SPECS.items():
        original = _original(getattr(c10d, name))
        wrapper = _traced(name, spec, original)
        for module in (dist,) if name in _PACKAGE_ONLY else (dist, c10d):
            _saved.append((module, name, getattr(module, name)))
            setattr(module, name, wrapper)
    _saved.append((dist, "batch_isend_irecv", dist.batch_isend_irecv))
    dist.batch_isend_irecv = _traced_batch(_original(c10d.batch_isend_irecv))
    _saved.append((dist, "P2POp", dist.P2POp))
    dist.P2POp = _P2POp


def uninstall() -> None:
    while _saved:
        module, name, original = _saved.pop()
        setattr(module, name, original)
