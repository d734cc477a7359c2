"""The worker side of the test pool: one process per rank, started once, running tasks.

    fork (torch already imported) -> init Gloo group over a FileStore -> "ready"
    loop: recv (sys.path, payload) -> fn(*args, **kwargs) -> send ("ok"|"error", ...)

Each task's prints are captured and sent back with its result; the worker's own file
descriptors 1 and 2 go to a log file that the pool shows when a worker dies. SIGUSR1
dumps every thread's Python stack to the stack file (faulthandler), so a hung task can
be reported without the worker's cooperation.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import pickle
import signal
import sys
import traceback

# torch loads torch._dynamo (and its distributed tensor modules) on a tensor subclass's first
# dispatch: import it once here, in the forkserver, instead of once per rank.
import torch
import torch._dynamo  # noqa: F401

import plait.comm as comm
from plait.comm import algorithms, events

PG_TIMEOUT_S = 900.0  # longer than any test timeout: the pool's own timeout fires first


def _reset_state(baseline_listeners: tuple) -> None:
    """Undo what a task may have left behind that would change the next task's meaning."""
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    for listener in events.listeners():
        if listener not in baseline_listeners:
            events.remove_listener(listener)
    algorithms._overrides.clear()


def main(rank: int, world_size: int, conn, store_path: str, log_path: str, stack_path: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file)  # a segfault leaves its stack too
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C goes to pytest, which stops the pool
    torch.set_num_threads(1)
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", rank),
                        ("LOCAL_WORLD_SIZE", world_size), ("OMP_NUM_THREADS", 1)):
        os.environ[name] = str(value)
    store = torch.distributed.FileStore(store_path, world_size)
    comm.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=PG_TIMEOUT_S)
    conn.send(("ready", rank))
    baseline = events.listeners()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        path, payload = message
        sys.path[:] = path
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                fn, args, kwargs = pickle.loads(payload)
                fn = getattr(fn, "__plait_body__", fn)
                result = fn(*args, **kwargs)
            reply = ("ok", pickle.dumps(result), out.getvalue())
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            reply = ("error", traceback.format_exc(), out.getvalue())
        finally:
            _reset_state(baseline)
        try:
            conn.send(reply)
        except Exception:  # the result did not pickle
            conn.send(("error", traceback.format_exc(), out.getvalue()))
