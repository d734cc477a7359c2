"""Print to stdout and stderr, including a partial line; FAIL_FIRST=1: rank 1 fails in attempt 0."""

import os
import sys
import time

import _common

_common.register()
r, a = _common.rank(), _common.attempt()
print(f"out {r} attempt {a}", flush=True)
print(f"err {r} attempt {a}", file=sys.stderr, flush=True)
if os.environ.get("PARTIAL") == "1":
    sys.stdout.write("prompt> ")
    sys.stdout.flush()
    time.sleep(0.4)  # longer than the launcher's idle flush
    print("answer")
_common.write(f"talked_a{a}_r{r}", 1)
if os.environ.get("FAIL_FIRST") == "1" and a == 0 and r == 1:
    for other in range(_common.world()):  # fail only once every rank has spoken
        _common.wait_for(f"talked_a0_r{other}")
    raise SystemExit(3)
