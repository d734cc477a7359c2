"""The first code a Python worker runs: arm the error file, then run the user's script as `__main__`.

    python -u .../plait/run/bootstrap.py train.py --lr 1     ≡  python -u train.py --lr 1
    python -u .../plait/run/bootstrap.py -m pkg.train --lr 1  ≡  python -u -m pkg.train --lr 1

The launcher runs this file by path, so it must stay standard-library only and import no plait
module: a worker that never touches torch starts in tens of milliseconds, and a user module
named `errors` or `logs` is never shadowed. Before the script runs it

- installs an excepthook that writes the uncaught exception to `TORCHELASTIC_ERROR_FILE` in
  torch's format (what `@record` writes), so the launcher can name the traceback without the
  script opting in;
- asks the kernel to SIGKILL this worker if its agent dies (Linux `PR_SET_PDEATHSIG`), so a
  killed `plait run` never leaves workers behind.

`plait.run.errors.record` imports `write_error_file` from here: one writer, one format.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback

_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def error_file_path() -> str | None:
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or os.environ.get("PLAIT_ERROR_FILE")


def write_error_file(exc: BaseException, tb_text: str | None = None, *, overwrite: bool = True) -> None:
    """Write `exc` to the error file the launcher named, in torch's TORCHELASTIC_ERROR_FILE format."""
    path = error_file_path()
    if not path or (not overwrite and os.path.exists(path)):
        return
    if tb_text is None:
        tb_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": tb_text, "timestamp": str(int(time.time()))},
        }
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # the agent never reads half a file


def _user_frames(tb):
    """Skip the frames of this file and runpy, so the traceback starts in the user's script."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}

    def launcher_frame(filename: str) -> bool:
        return filename.startswith("<frozen runpy") or os.path.abspath(filename) in ours

    while tb is not None and launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _excepthook(exc_type, exc, tb) -> None:
    tb = _user_frames(tb) or tb
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    try:
        # `@record` may already have written this exception, with its own stack: keep that one.
        write_error_file(exc, text, overwrite=False)
    finally:
        sys.stderr.write(text)
        sys.stderr.flush()


def _die_with_agent() -> None:
    agent_pid = int(os.environ.get("PLAIT_AGENT_PID", "0") or 0)
    if not agent_pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL)
    if os.getppid() != agent_pid:  # the agent died before the request took effect
        os._exit(1)


def main(argv: list[str]) -> None:
    _die_with_agent()
    sys.excepthook = _excepthook
    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(script))  # what `python script.py` puts first
        runpy.run_path(os.path.abspath(script), run_name="__main__")  # __file__ absolute, as python


if __name__ == "__main__":
    main(sys.argv[1:])
