"""Imported at start-up by every Python process a launcher test starts (tests/run/conftest puts
this folder first on PYTHONPATH): SIGUSR2 writes every thread's Python stack to
$PLAIT_TEST_STACKS/<pid>.txt, so a test that times out can say where each process was.

SIGUSR2 is not one of `plait run`'s handled signals, and nothing in plait or the test workers
installs a handler for it; faulthandler's handler is async-signal-safe and runs even while the
main thread is blocked in C (a Gloo wait, a store call).
"""

import os

_dir = os.environ.get("PLAIT_TEST_STACKS")
if _dir:
    import faulthandler
    import signal

    _file = open(os.path.join(_dir, f"{os.getpid()}.txt"), "w")  # kept open for the handler
    faulthandler.register(signal.SIGUSR2, file=_file, all_threads=True)
