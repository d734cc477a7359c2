"""plait's exit hook in a process made by os.fork() (tests/readme_driver.py runs each README
example in one) waits for Gloo's native threads, not for the thread that runs it.

CPython 3.11 keeps the parent's id in a fork's `threading.main_thread().native_id`; the hook
took the child's own, running, main thread for a native thread that never parks and polled
until PLAIT_EXIT_QUIESCE_S (10 s and ~2 CPU s per forked child, measured in the README driver).
"""

import ast
import os
import threading

from plait.comm import shutdown


def test_exit_hook_in_a_fork_does_not_wait_for_its_own_thread():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fresh thread id; only the forking thread survives
        try:
            tids = shutdown._native_threads()
            parked = shutdown.wait_until_native_threads_park(5.0)
            os.write(write, repr((str(threading.get_native_id()) in tids, parked)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        own_thread_listed, parked = ast.literal_eval(f.read())
    assert not own_thread_listed and parked, (own_thread_listed, parked)
