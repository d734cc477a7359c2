"""Streams and events: where plait overlaps copies and communication with compute.

    group_device(group)          -> the device a group's tensors live on (NCCL: the current
                                    accelerator; Gloo: the CPU) — control-plane tensors too
    side_stream(device, name)    -> one stream per (device, name) per process; None on CPU
    current_stream(device)       -> the stream compute runs on; None on CPU
    wait_stream(s, other)        -> work issued on s later runs after what other holds now
    record_event(s) -> e         ;  wait_event(s, e): s waits for the work before e
    stream_context(s)            -> `with`: ops issued inside run on s

The contract: every call takes None for a stream (and returns None for an event) and does
nothing; on a CPU there is one ordered stream of work, the host's, so every order the calls
promise already holds. Callers look their streams up once (`side_stream`) and branch on
`is None` in the step, so on CPU a step allocates nothing and calls nothing here.

Lifetime: a tensor allocated on one stream and read on another must not be freed (and
reused by its own stream) before the reader is done. plait follows torch's FSDP2 and never
calls record_stream: the allocating stream waits on an event recorded after the last read
before the last reference is dropped (see plait.fsdp.group).

On an accelerator the calls are torch's device-generic ones (`torch.Stream`, `torch.Event`,
`torch.accelerator`). Tests swap the backend (`use_backend`) for one that gives streams on
the CPU and logs each call, to check the order a strategy promises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait.comm.group import group_info

CPU = torch.device("cpu")
HOST_BACKENDS = frozenset({"gloo", "mpi"})  # collectives on host memory
_NULL = contextlib.nullcontext()  # reusable: stream_context(None) allocates nothing


def group_device(group: ProcessGroup) -> torch.device:
    """Where `group`'s collectives take tensors: the CPU for Gloo, else the current accelerator."""
    if group_info(group).backend in HOST_BACKENDS:
        return CPU
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return CPU
    return torch.device(acc.type, torch.accelerator.current_device_index())


class AcceleratorBackend:
    """torch's device-generic streams; no streams for the CPU or meta devices."""

    def has_streams(self, device: torch.device) -> bool:
        return device.type not in ("cpu", "meta") and torch.accelerator.is_available()

    def new_stream(self, device: torch.device, name: str) -> Any:
        return torch.Stream(device=device, priority=-1)  # high priority: comm/copies first

    def current_stream(self, device: torch.device) -> Any:
        return torch.accelerator.current_stream(device)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return stream  # torch.Stream is a context manager that makes it current


_backend: Any = AcceleratorBackend()
_streams: dict[tuple[torch.device, str], Any] = {}


@contextlib.contextmanager
def use_backend(backend: Any) -> Iterator[Any]:
    """Tests: streams and events from `backend` inside the block (streams looked up inside
    it are that backend's), then back to the accelerator's."""
    global _backend
    saved, saved_streams = _backend, dict(_streams)
    _backend = backend
    _streams.clear()
    try:
        yield backend
    finally:
        _backend = saved
        _streams.clear()
        _streams.update(saved_streams)


def side_stream(device: torch.device, name: str) -> Any | None:
    """The stream called `name` on `device`, created once per process; None without streams."""
    key = (device, name)
    found = _streams.get(key)
    if found is None:
        if not _backend.has_streams(device):
            return None
        found = _streams[key] = _backend.new_stream(device, name)
    return found


def current_stream(device: torch.device) -> Any | None:
    """The stream ops on `device` are issued to now; None without streams."""
    if not _backend.has_streams(device):
        return None
    return _backend.current_stream(device)


def wait_stream(stream: Any | None, other: Any | None) -> None:
    """Work issued on `stream` from now on starts after the work issued on `other` so far."""
    if stream is not None and other is not None and stream is not other:
        _backend.wait_stream(stream, other)


def record_event(stream: Any | None) -> Any | None:
    """An event that completes when the work issued on `stream` so far has."""
    return None if stream is None else _backend.record_event(stream)


def wait_event(stream: Any | None, event: Any | None) -> None:
    """Work issued on `stream` from now on starts after `event`."""
    if stream is not None and event is not None:
        _backend.wait_event(stream, event)


def stream_context(stream: Any | None) -> contextlib.AbstractContextManager:
    """`with stream_context(s):` issues the block's ops on `s` (nothing, for None)."""
    return _NULL if stream is None else _backend.stream_context(stream)


__all__ = [
    "AcceleratorBackend", "current_stream", "group_device", "record_event", "side_stream",
    "stream_context", "use_backend", "wait_event", "wait_stream",
]
