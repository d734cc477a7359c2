"""Helpers for the throw-away worker scripts of tests/run (imported from the script's directory).

Every process a test starts registers its pid here, so the test can check afterwards that none
of them outlived the launcher. No torch: these workers start in tens of milliseconds.
"""

import json
import os
import time

OUT = os.environ.get("PLAIT_TEST_OUT", ".")


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


def wait_for(name: str, timeout: float = 300.0) -> bool:
    """Wait for another process's output file: as long as conftest.HANG_S, for a loaded machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(OUT, name)):
            return True
        time.sleep(0.05)
    return False
