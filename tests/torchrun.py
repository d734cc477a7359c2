"""torchrun for the tests that compare with it: torch.distributed.run, each worker in its own
process group in the launcher's session instead of its own session.

torch's launcher starts every worker in a new session (SubprocessHandler, start_new_session).
Without a controlling terminal a session changes nothing but the scheduler's autogroup, and a
fresh autogroup waits for the CPU behind a busy one (plait/run/workers.py has the figures): a
test comparing with torchrun timed out on a busy machine for a reason unrelated to what it
checks. So this runs torchrun as `plait run` starts workers (own_group); nothing else changes.

    ARGV + [torchrun's flags, script, args]   in place of   [python, -m, torch.distributed.run, ...]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ARGV = [sys.executable, str(Path(__file__).resolve())]


def main() -> None:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    from torch.distributed.run import main as torchrun

    from plait.run.workers import own_group

    def popen(self, args, env):
        return subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr, **own_group())

    subprocess_handler.SubprocessHandler._popen = popen
    torchrun()


if __name__ == "__main__":
    sys.path.pop(0)  # tests/ itself: its packages (run, tensor, data, ...) must not shadow any import
    main()
