"""Start a background child process and exit 0 without waiting for it."""

import subprocess
import sys

import _common

_common.register()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "plait-test-child"])
_common.register(child.pid)
_common.write(f"child_r{_common.rank()}", child.pid)
