"""A torch-preloaded parent that forks the rank processes of tests/debug's jobs (jobs.py).

    jobs.start ─JSON line {argv, env, cwd, log, status}─▶ zygote (torch imported once)
        fork ─▶ child: env, cwd, fds 0/1/2 set as Popen would ─▶ runs argv[0] as __main__
                ─▶ ends as a fresh interpreter does (atexit, finalization, exit code)
    zygote ─JSON line {pid}─▶ jobs.start;  on the child's exit ─▶ its exit code in `status`

Every rank of a job was a fresh `python scenarios.py NAME`: 16 processes each paying torch's
import (1.5 CPU s, 2 of the ~2 s a rank costs). A forked child has torch already and otherwise
starts as that script would: its own environment (plait, imported in the child, reads PLAIT_*
then), `sys.argv`, `sys.path[0]` the script's folder, its output to its log. It is a real
process: the watchdog ends it, a signal reaches it, nothing but its exit code passes back.
What the zygote cannot give is a fresh interpreter's start-up (PYTHONPATH's sitecustomize,
-X options): jobs.py still execs a job whose environment sets PYTHONPATH.

The zygote is single-threaded (a fork copies only the calling thread). A child's exit code is
written to its status file before the child is reaped, so its pid is never reused while the
test may still signal it.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys

import torch  # noqa: F401 - the import every child shares
import torch.distributed  # noqa: F401


def _child(request: dict, log: int) -> None:
    """Become the requested process, its output to `log` (a descriptor); never returns to the
    zygote's loop."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")  # an uncaught exception ends the child with 1, as python does
    raise SystemExit(0)


def _reap(statuses: dict[int, str]) -> None:
    """Write each exited child's exit code (Popen's: -N for signal N), then reap it."""
    while statuses:
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        path = statuses.pop(info.si_pid)
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)
        os.waitpid(info.si_pid, 0)


def main() -> None:
    statuses: dict[int, str] = {}
    requests = os.fdopen(0, "r")
    while True:
        ready, _, _ = select.select([requests], [], [], 0.02)
        _reap(statuses)
        if not ready:
            continue
        line = requests.readline()
        if not line:  # the test process ended: its children's exit codes no longer matter
            return
        request = json.loads(line)
        # the log exists before the reply, as Popen's would: a test may read it at once
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:
            _child(request, log)
        os.close(log)
        statuses[pid] = request["status"]
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
