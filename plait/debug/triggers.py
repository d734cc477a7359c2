"""What makes a rank dump its flight recorder without being asked in code: SIGUSR1 and an
unhandled exception.

    kill -USR1 <pid> -> CPython's C handler writes the signal number to a wakeup pipe
                     -> "plait-debug-signals" thread reads it -> on_signal()
    uncaught exception (main thread or any thread) -> on_exception(exc) -> previous hook

A Python signal handler alone would run only when the main thread next executes bytecode,
which a rank blocked inside a collective never does; the wakeup pipe is served by our own
thread, so `kill -USR1` dumps a hung rank at once. SIGUSR1 is taken only when nobody else
(Python or C, e.g. faulthandler) handles it, and only from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()
_signal_state: dict | None = None  # {"read": fd, "write": fd, "previous_wakeup": fd, "thread": Thread}
_hooks: dict | None = None  # {"sys": previous sys.excepthook, "threading": previous threading.excepthook}


def _c_handler_is_default(signum: int) -> bool:
    """True when no handler at all is installed for `signum` (faulthandler installs one at
    the C level that Python's signal.getsignal does not see)."""
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = ctypes.create_string_buffer(256)  # larger than any struct sigaction
        if libc.sigaction(signum, None, old) != 0:
            return False
        return ctypes.c_void_p.from_buffer(old).value in (None, 0)  # sa_handler comes first
    except (OSError, AttributeError):
        return True


def install_signal(on_signal: Callable[[int], None], signum: int = signal.SIGUSR1) -> bool:
    """Route `signum` to `on_signal` (called on our thread); False when it was not ours to take."""
    global _signal_state
    with _lock:
        if _signal_state is not None:
            return True
        if threading.current_thread() is not threading.main_thread() or not _c_handler_is_default(signum):
            return False
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            os.close(read), os.close(write)
            return False
        if previous != -1:  # someone (asyncio) owns the wakeup fd: give it back, stay out
            signal.set_wakeup_fd(previous)
            os.close(read), os.close(write)
            return False
        signal.signal(signum, lambda *_: None)  # served by the thread below, not here
        thread = threading.Thread(target=_serve, args=(read, signum, on_signal),
                                  name="plait-debug-signals", daemon=True)
        _signal_state = {"read": read, "write": write, "signum": signum, "thread": thread}
        thread.start()
        return True


def _serve(read: int, signum: int, on_signal: Callable[[int], None]) -> None:
    while True:
        try:
            select.select([read], [], [])
            data = os.read(read, 64)
        except OSError:
            return  # the pipe was closed: uninstalled
        if not data:
            return
        if signum in data:
            try:
                on_signal(signum)
            except Exception as e:  # noqa: BLE001 - a failed dump must not kill the thread
                sys.stderr.write(f"plait.debug: dump on signal {signum} failed: {type(e).__name__}: {e}\n")


def uninstall_signal(*, in_forked_child: bool = False) -> None:
    global _signal_state
    with _lock:
        state, _signal_state = _signal_state, None
    if state is None:
        return
    if in_forked_child or threading.current_thread() is threading.main_thread():
        signal.set_wakeup_fd(-1)
        signal.signal(state["signum"], signal.SIG_DFL)
    os.close(state["write"])
    os.close(state["read"])


def install_excepthooks(on_exception: Callable[[BaseException], None]) -> None:
    """Call `on_exception` for any uncaught exception (then the hook that was there)."""
    global _hooks
    if _hooks is not None:
        return
    _hooks = {"sys": sys.excepthook, "threading": threading.excepthook}
    previous_sys, previous_threading = _hooks["sys"], _hooks["threading"]

    def sys_hook(kind, exc, tb):
        if not issubclass(kind, KeyboardInterrupt):
            _safely(on_exception, exc)
        previous_sys(kind, exc, tb)

    def threading_hook(args):
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            _safely(on_exception, args.exc_value)
        previous_threading(args)

    sys.excepthook = sys_hook
    threading.excepthook = threading_hook
    _hooks.update(ours_sys=sys_hook, ours_threading=threading_hook)


def uninstall_excepthooks() -> None:
    """Put back the previous hooks, unless somebody has chained onto ours since."""
    global _hooks
    if _hooks is not None:
        if sys.excepthook is _hooks["ours_sys"]:
            sys.excepthook = _hooks["sys"]
        if threading.excepthook is _hooks["ours_threading"]:
            threading.excepthook = _hooks["threading"]
        _hooks = None


def _safely(fn: Callable[[BaseException], None], exc: BaseException) -> None:
    try:
        fn(exc)
    except Exception as e:  # noqa: BLE001 - the original traceback must still be printed
        sys.stderr.write(f"plait.debug: dump on exception failed: {type(e).__name__}: {e}\n")
