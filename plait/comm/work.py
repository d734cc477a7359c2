"""`Handle`: what an op returns with `async_op=True`.

    op issued -> Handle(work, finish) -> wait(): work.wait(); result = finish(); on_end

`finish` turns the backend's raw output into the op's result (slicing a padded gather,
copying into `out=`); it runs exactly once, whether through `wait()` or the future.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from plait.comm import events, shutdown


class Handle:
    """An op in flight. `wait()` blocks until it completes and returns its result."""

    __slots__ = ("_work", "_finish", "_event", "_done", "_result", "_lock", "__weakref__")

    def __init__(
        self,
        work: Any | None,
        finish: Callable[[], Any],
        event: events.CommEvent | None = None,
    ) -> None:
        self._work = work  # a c10d Work, or None for an op that completed locally
        self._finish = finish
        self._event = event
        if event is not None:
            event.work = work
        self._done = False
        self._result: Any = None
        self._lock = threading.Lock()

    def _complete(self) -> Any:
        with self._lock:
            if not self._done:
                self._result = self._finish()
                self._done = True
                self._finish = None  # type: ignore[assignment]  # drop buffers it captured
                if self._event is not None:
                    self._event.work = None
                    events.emit_end(self._event)
        return self._result

    def wait(self) -> Any:
        """Block until the op completes; return its result (the same object every call)."""
        if not self._done:
            if self._work is not None:
                self._work.wait()
            result = self._complete()
            self._work = None  # a held Work holds the op's buffers
            return result
        return self._result

    def __del__(self, _dropped: Callable[[Any], None] = shutdown.dropped) -> None:
        # bound at definition: a handle collected during finalization finds the module cleared
        if not self._done and self._work is not None:
            _dropped(self._work)
            event = self._event
            if event is not None and self._work.is_completed():
                event.work = None  # a flight recorder keeps the event: not the Work's buffers

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        """A torch Future whose value is the op's result (for DDP comm hooks)."""
        if self._work is None or self._done:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(self.wait())
            return fut
        return self._work.get_future().then(lambda _: self._complete())


def completed(result: Any, event: events.CommEvent | None = None) -> Handle:
    """A handle for an op that needed no communication (a group of one)."""
    handle = Handle(None, lambda: result, event)
    handle._complete()
    return handle
