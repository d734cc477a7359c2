"""A clean exit for a job that used Gloo: no "terminate called without an active exception".

The mechanism (pytorch#190489; the script in tests/comm/test_exit.py reproduces it):

    Gloo worker thread:  run op -> mark its Work completed -> [main thread wakes] -> drop its
                         reference to the Work (and so to the op's tensors) -> wait for the next op

A tensor whose Python object died while C++ still held the tensor keeps that Python object
alive from C++; freeing such a tensor takes the GIL, as does a Python callback on the op's
future (plait's Handle.get_future, DDP comm hooks), which runs on the worker. If the worker's drop comes after Python
has begun finalizing (the main thread was quicker: a loaded machine, a short script), the
worker's GIL request makes CPython end the thread with `pthread_exit`, whose unwinding through
a C++ noexcept frame calls std::terminate: the core-dump line and exit code 134 after a job
that finished. The same happens to an op still in flight when the script ends.

`ProcessGroupGloo`'s destructor joins its worker threads, so a group destroyed before
finalization is safe. `destroy_process_group()` only destroys it when nothing else holds it,
and a script that keeps `g = comm.world_group()` at module level (as the README teaches), a
mesh or a DDP model holds it into finalization. So at exit, while the interpreter is whole,
`_at_exit`:

1. waits (bounded) for the collectives issued with `async_op=True` that have not completed;
2. destroys every group (torch's maps, plait's caches), so that every group no Python object
   still holds is destroyed here and its workers joined;
3. for the groups still held (by the script, or by cycles that only finalization collects:
   a gc.collect() here costs ~1 s with torch loaded), waits until every native thread
   (Gloo's workers; not Python's own threads, nor Gloo's self-waking transport loop) is
   parked: none runnable and none has run across a short sleep in which this thread held
   no GIL. A worker with a drop still to do is runnable,
   or runs as soon as the GIL is free; one parked afterwards has nothing left that touches
   Python. The wait is bounded (`PLAIT_EXIT_QUIESCE_S`, default 10 s): a thread that never
   parks (an op whose peer never comes) cannot be made safe from Python.

Armed once, by the first Gloo group plait sees; NCCL groups are left to the script (their
shutdown can wait on peers still in a collective).
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import time
import weakref

_armed = False
_live: weakref.WeakSet = weakref.WeakSet()  # Handles of async collectives not yet waited
_in_flight: collections.deque = collections.deque()  # Works of handles dropped unwaited, oldest first
_prune_at = 64  # scan the whole deque when it grows past this; doubles with what stays
_lock = threading.Lock()  # plait.testing runs one rank per thread in a process
_POLL_S = 0.002  # one observation window: long enough for a woken thread to be seen running
# Gloo's transport loop wakes every few ms on its own (an epoll timeout) and never touches
# Python; counting it would make the wait a lottery. Threads are told apart by name.
_POLLING = frozenset({"gloo_tcp_loop"})


_before_exit: list = []  # listeners that must still see the groups (plait.debug's last state)


def before_exit(fn) -> None:
    """Run `fn()` at exit before any group is destroyed (once per fn). plait.debug publishes
    each rank's last state there: destroyed groups would report no op at all."""
    if fn not in _before_exit:
        _before_exit.append(fn)


def arm() -> None:
    """Register the exit hook (once per process)."""
    global _armed
    if not _armed:
        _armed = True
        atexit.register(_at_exit)


def track(handle) -> None:
    """Remember an async op's Handle, weakly, until the script waits for it or drops it.
    A strong reference to the c10d Work would keep the op's buffers alive past their use
    (measured: +8 to +17 MiB peak per rank in an FSDP step); the Work is held only once its
    Handle is dropped unwaited (`dropped`)."""
    if not _armed:
        return  # no Gloo group: nothing to make safe
    with _lock:
        _live.add(handle)


def dropped(work) -> None:
    """A Handle died before its op completed: keep the Work until it does, so the exit hook
    can wait for it."""
    global _prune_at
    if not _armed or work.is_completed():
        return
    with _lock:
        while _in_flight and _in_flight[0].is_completed():
            _in_flight.popleft()
        if len(_in_flight) >= _prune_at:  # an old op that never completes must not pin the rest
            kept = [w for w in _in_flight if not w.is_completed()]
            _in_flight.clear()
            _in_flight.extend(kept)
            _prune_at = max(64, 2 * len(kept))
        _in_flight.append(work)


def pending_works() -> list:
    """Every async op's Work not known to be complete: of live handles not yet waited, and
    of handles dropped unwaited."""
    with _lock:
        live = [h._work for h in list(_live) if h._work is not None and not h._done]
        return live + list(_in_flight)


def _at_exit() -> None:
    from plait.comm import group  # at exit, not import time: group imports this file

    for fn in _before_exit:
        fn()
    deadline = time.monotonic() + float(os.environ.get("PLAIT_EXIT_QUIESCE_S", "10"))
    pending = pending_works()
    with _lock:
        _in_flight.clear()
    for work in pending:
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # polled, not wait(): a timed-out wait would fail the op loudly
    group.destroy_process_group()
    wait_until_native_threads_park(max(0.0, deadline - time.monotonic()))


def _native_threads() -> list[str] | None:
    """Thread ids of this process that Python's threading module did not start; None
    without /proc."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    # this thread by the kernel's id: after os.fork() CPython 3.11 keeps the parent's id in
    # threading.main_thread().native_id, and a forked child's hook took itself for a runnable
    # native thread and polled to the deadline (PLAIT_EXIT_QUIESCE_S: 10 s, ~2 CPU s)
    python = {t.native_id for t in threading.enumerate()} | {threading.get_native_id()}
    return [tid for tid in tids if int(tid) not in python]


def _snapshot(tids: list[str]) -> dict[str, tuple[bool, str]] | None:
    """tid -> (runnable, cumulative run time), for threads not in `_POLLING`; None where
    /proc does not tell."""
    seen = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() in _POLLING:
                    continue
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran = f.read().split()[0]
        except FileNotFoundError:
            continue  # the thread ended: nothing left for it to do
        except OSError:
            return None
        state = stat[stat.rfind(b")") + 2:][:1]
        seen[tid] = (state == b"R", ran)
    return seen


def wait_until_native_threads_park(timeout: float) -> bool:
    """Block (GIL released) until no native thread is runnable or has run for one window;
    True when they parked within `timeout` seconds. Without /proc: one window's sleep."""
    deadline = time.monotonic() + timeout
    while True:
        tids = _native_threads()
        if tids is None:
            time.sleep(_POLL_S)
            return False
        if not tids:
            return True
        before = _snapshot(tids)
        time.sleep(_POLL_S)  # the GIL is free: a thread waiting for it runs now
        after = _snapshot(tids)
        if before is None or after is None:
            return False
        if not any(runnable for runnable, _ in after.values()) and all(
            before.get(tid, after[tid])[1] == ran for tid, (_, ran) in after.items()
        ):
            return True
        if time.monotonic() >= deadline:
            return False
