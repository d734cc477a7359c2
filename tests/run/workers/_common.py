"""Helpers for the throw-away worker scripts of tests/run (imported from the script's directory).

Every process a test starts registers its pid here, so the test can check afterwards that none
of them outlived the launcher. No torch: these workers start in tens of milliseconds.
"""

import json
import os
import time

OUT = os.environ.get("PLAIT_TEST_OUT", ".")
# The bound on every wait for an event, here and in conftest: a launch takes seconds, a hang forever.
# In full-suite runs under ci-under-load -j 2 a process started in its own session (every agent and
# worker here) was measured importing torch in 8-10 s at load 8-11 (4-5 s in the caller's session),
# and an agent once took ~60 s for it; a restart chains three such imports (agent, attempt 0,
# attempt 1), and two -j 2 runs each failed one launch at 120 s. 300 s holds that; a passing test
# never waits it.
HANG_S = 300.0


def register(pid: int | None = None) -> None:
    pids = os.environ.get("PLAIT_TEST_PIDS")
    if pids:
        open(os.path.join(pids, str(pid or os.getpid())), "w").close()


def rank() -> int:
    return int(os.environ["RANK"])


def attempt() -> int:
    return int(os.environ["PLAIT_RESTART_COUNT"])


def world() -> int:
    return int(os.environ["WORLD_SIZE"])


def write(name: str, data) -> None:
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def wait_for(name: str, timeout: float = HANG_S) -> bool:
    """Wait for another process's output file, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(OUT, name)):
            return True
        time.sleep(0.05)
    return False
