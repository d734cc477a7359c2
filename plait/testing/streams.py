"""A stream backend for tests: streams on the CPU that run nothing and log every call.

    with comm.device.use_backend(RecordingStreams()) as rec, rec.listening():
        ...one step...
    rec.log == ["ag_copy_in.wait_stream(default)", "enter ag_copy_in", ..., "all_gather on ag", ...]

Each entry names the stream by the name the strategy gave it (`side_stream(device, name)`,
its last dotted part) and events as e1, e2, ... in the order they were recorded; `listening()`
also logs each collective and p2p op with the stream current when it was issued, so a test can
check an op runs where the strategy says and after the waits it promises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from plait.comm.events import CommEvent, CommListener, listening


class FakeStream:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    __slots__ = ("name", "stream")

    def __init__(self, name: str, stream: FakeStream) -> None:
        self.name, self.stream = name, stream

    def __repr__(self) -> str:
        return self.name


class RecordingStreams:
    """Streams for every device (the CPU included); each call appends one line to `log`."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.default = FakeStream("default")
        self.current = self.default
        self.events = 0

    def has_streams(self, device: torch.device) -> bool:
        return True

    def new_stream(self, device: torch.device, name: str) -> FakeStream:
        return FakeStream(name.rsplit(".", 1)[-1])

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        self.log.append(f"{stream}.wait_stream({other})")

    def record_event(self, stream: FakeStream) -> FakeEvent:
        self.events += 1
        event = FakeEvent(f"e{self.events}", stream)
        self.log.append(f"{stream}.record({event})")
        return event

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self.log.append(f"{stream}.wait({event})")

    @contextlib.contextmanager
    def stream_context(self, stream: FakeStream) -> Iterator[None]:
        saved, self.current = self.current, stream
        self.log.append(f"enter {stream}")
        try:
            yield
        finally:
            self.current = saved
            self.log.append(f"exit {stream}")

    @contextlib.contextmanager
    def listening(self) -> Iterator[RecordingStreams]:
        """Also log each comm op as `"<op> on <stream>"`."""
        with listening(_OpLog(self)):
            yield self


class _OpLog(CommListener):
    wants_end = False

    def __init__(self, rec: RecordingStreams) -> None:
        self.rec = rec

    def on_start(self, event: CommEvent) -> None:
        self.rec.log.append(f"{event.op} on {self.rec.current}")


__all__ = ["FakeEvent", "FakeStream", "RecordingStreams"]
