"""Rank FAIL_RANK (default 1) raises in the first attempt; every later attempt succeeds."""

import os

import _common

_common.register()
_common.write(f"ran_a{_common.attempt()}_r{_common.rank()}", os.environ["PLAIT_RESTART_COUNT"])
if _common.attempt() == 0 and _common.rank() == int(os.environ.get("FAIL_RANK", "1")):
    # fail only once every rank has started, so each one's first attempt is on record
    for other in range(_common.world()):
        _common.wait_for(f"ran_a0_r{other}")
    raise RuntimeError(f"planned failure on rank {_common.rank()}")
print(f"rank {_common.rank()} done in attempt {_common.attempt()}")
