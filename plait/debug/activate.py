"""Turning debugging on from the environment, cheaply, as soon as a script uses plait.

    import plait       -> this module: when PLAIT_DISTRIBUTED_DEBUG / PLAIT_DESYNC_DEBUG ask
                          for debugging, activate as soon as torch is imported (now, if it
                          already is) — so a script calling torch.distributed directly is
                          covered from its first collective, and `plait run`, which imports
                          plait but never torch, stays torch-free
    import plait.comm  -> on_comm_import(): the session from the environment — at least the
                          flight recorder, which is on unless PLAIT_TRACE_BUFFER_SIZE=0
    a `plait run` worker that never imports plait: the launcher puts bootstrap_dir() first
                          on PYTHONPATH; its sitecustomize.py imports this module

Standard library only (config.py included): importing this module never imports torch.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

from plait.debug.config import env_asks_for_debugging


def on_comm_import() -> None:
    from plait.debug import session

    session.activate_from_env()


def bootstrap_dir() -> str:
    """The folder whose sitecustomize.py activates debugging in a worker that does not
    import plait (prepend it to the workers' PYTHONPATH)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


class _AfterTorch:
    """A meta-path finder that imports plait.comm (which activates debugging) once torch has
    loaded. Not on torch.distributed: torch imports it half-way through its own __init__,
    too early for plait."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_activate(module: object) -> None:
            exec_module(module)
            try:
                import plait.comm  # noqa: F401 - activates through on_comm_import
            except Exception as e:  # noqa: BLE001 - never break the script's own import of torch
                sys.stderr.write(f"plait.debug: could not activate debugging: {type(e).__name__}: {e}\n")

        spec.loader.exec_module = exec_then_activate
        return spec


def activate_when_torch_loads() -> None:
    if "torch" in sys.modules:
        import plait.comm  # noqa: F401 - activates through on_comm_import
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


if env_asks_for_debugging():
    activate_when_torch_loads()
