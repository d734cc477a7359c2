"""For multi-node tests: announce running_a<attempt>_r<rank>_w<world>, then wait.

Exits 0 once the file RELEASE exists and the world has RELEASE_WORLD ranks; otherwise waits to
be stopped (a regroup or restart starts it again with the new world)."""

import os
import time

import _common

_common.register()
_common.write(f"running_a{_common.attempt()}_r{_common.rank()}_w{_common.world()}",
              {"pid": os.getpid(), "group_rank": os.environ["GROUP_RANK"]})
release_world = int(os.environ.get("RELEASE_WORLD", "0"))
deadline = time.monotonic() + 180  # spans a lost node noticed, a restart, a regroup on a loaded machine
while time.monotonic() < deadline:
    if _common.world() == release_world and os.path.exists(os.path.join(_common.OUT, "RELEASE")):
        print(f"rank {_common.rank()} released in world {_common.world()}")
        raise SystemExit(0)
    time.sleep(0.05)
raise SystemExit(3)
