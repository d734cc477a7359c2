"""Signals to the launcher, and the one wait every loop of the agent sleeps in.

    SIGTERM/SIGINT/… ──handler──▶ SignalWatcher.received ──check()──▶ SignalReceived(signum)
          └──────── wakeup fd ──▶ Waker.wait() returns at once
    a worker exits (SIGCHLD) or its pipe closes (LogPump) ──▶ Waker.wait() returns at once

The handlers only record the signal; the agent acts on it at its next check, between two
steps, never in the middle of starting a process. Every wait of the agent is `Waker.wait`
with a bound, so a signal or a worker's exit is noticed within one monitor interval or less.
A second signal while workers are being stopped skips the grace period (SIGKILL at once).
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Sequence


class SignalReceived(Exception):
    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process killed by the signal


class Waker:
    """A self-pipe: `wait` sleeps until the timeout, a `wake()` from any thread, or a signal."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()

    @property
    def write_fd(self) -> int:
        return self._w

    def wake(self) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (pipe full) or closed at exit

    def wait(self, timeout: float, fds: Sequence[int] = ()) -> list[int]:
        """Sleep up to `timeout` seconds; returns those of `fds` that became readable."""
        ready, _, _ = select.select([self._r, *fds], [], [], max(0.0, timeout))
        if self._r in ready:
            with self._lock:
                try:
                    while os.read(self._r, 4096):
                        pass
                except BlockingIOError:
                    pass
        return [fd for fd in ready if fd != self._r]

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def _ignore(signum, frame) -> None:
    pass


class SignalWatcher:
    """Install handlers for `signals` (main thread only); restore the previous ones on exit."""

    def __init__(self, signals: Sequence[signal.Signals], waker: Waker):
        self._signals = tuple(signals)
        self._waker = waker
        self._previous: dict[int, object] = {}
        self._old_wakeup_fd = -1
        self.received: list[int] = []

    def __enter__(self) -> SignalWatcher:
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        # a worker's exit wakes the agent at once (through the wakeup fd) instead of at its next poll
        self._previous.setdefault(signal.SIGCHLD, signal.signal(signal.SIGCHLD, _ignore))
        self._old_wakeup_fd = signal.set_wakeup_fd(self._waker.write_fd, warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._old_wakeup_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)

    def check(self) -> None:
        if self.received:
            raise SignalReceived(self.received[0])

    def hurry(self) -> bool:
        """A second signal: the user wants out now, not after the grace period."""
        return len(self.received) >= 2
