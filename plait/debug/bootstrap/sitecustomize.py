"""Debugging for a `plait run` worker that never imports plait: first on PYTHONPATH when
PLAIT_DISTRIBUTED_DEBUG or PLAIT_DESYNC_DEBUG is set, this file imports
`plait.debug.activate` (standard library only), which activates plait.debug — wrappers
around torch.distributed's collectives included — as soon as the worker imports torch.

    interpreter start -> this sitecustomize -> plait.debug.activate -> the script imports
    torch -> import plait.comm -> the session the environment asks for

Python imports only the first sitecustomize on the path; the one this file shadows (if
any) is run afterwards, so a site's own customization still happens. Nothing of plait is
imported when the environment does not ask for debugging.
"""

import importlib.util
import os
import sys


def _asks() -> bool:
    level = os.environ.get("PLAIT_DISTRIBUTED_DEBUG", "").strip().upper()
    return level not in ("", "OFF") or os.environ.get("PLAIT_DESYNC_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder == here or not os.path.isfile(candidate):
            continue
        spec = importlib.util.spec_from_file_location("_plait_shadowed_sitecustomize", candidate)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


if _asks():
    try:
        import plait.debug.activate  # noqa: F401 - activates once torch is imported
    except Exception as e:  # noqa: BLE001 - never stop the worker from starting
        sys.stderr.write(f"plait.debug bootstrap: could not activate debugging: {type(e).__name__}: {e}\n")
_run_shadowed()
