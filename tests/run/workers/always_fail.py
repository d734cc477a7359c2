"""Rank 1 fails in every attempt, after the other ranks started; they wait to be stopped."""

import time

import _common


def check_input(value):
    raise ValueError(f"rank 1 always fails (value={value})")


_common.register()
_common.write(f"ran_a{_common.attempt()}_r{_common.rank()}", _common.attempt())
if _common.rank() == 1:
    for other in range(_common.world()):  # every rank's attempt is on record before the failure
        _common.wait_for(f"ran_a{_common.attempt()}_r{other}")
    check_input(42)
time.sleep(60)
