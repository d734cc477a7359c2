"""Sleep until stopped. SPAWN_CHILD=1: start a child process first; IGNORE_TERM=1: ignore SIGTERM
(noting each one in termed_a<attempt>_r<rank>); SLEEP_ATTEMPTS=N: only attempts < N sleep, later
ones exit 0. Writes ready_a<attempt>_r<rank>."""

import os
import signal
import subprocess
import sys
import time

import _common

_common.register()
pids = {"worker": os.getpid()}
if os.environ.get("SPAWN_CHILD") == "1":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "plait-test-child"])
    _common.register(child.pid)
    pids["child"] = child.pid
if os.environ.get("IGNORE_TERM") == "1":  # the sleep goes on after the handler (PEP 475)
    signal.signal(signal.SIGTERM, lambda *_: _common.write(f"termed_a{_common.attempt()}_r{_common.rank()}", 1))
if _common.attempt() >= int(os.environ.get("SLEEP_ATTEMPTS", "1000")):
    print(f"rank {_common.rank()} attempt {_common.attempt()} exits at once")
    sys.exit(0)
_common.write(f"ready_a{_common.attempt()}_r{_common.rank()}", pids)
print(f"rank {_common.rank()} sleeping", flush=True)
time.sleep(60)
