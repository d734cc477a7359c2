"""Rank 0 starts a child process and waits; rank 1 fails once the child exists."""

import subprocess
import sys
import time

import _common

_common.register()
if _common.rank() == 0:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "plait-test-child"])
    _common.register(child.pid)
    _common.write("child_r0", child.pid)
    time.sleep(60)
else:
    _common.wait_for("child_r0")
    raise SystemExit(5)
