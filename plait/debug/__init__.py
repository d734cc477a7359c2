"""plait.debug — listens at plait.comm's door: counting, tracing, consistency checks, a
watchdog, a flight recorder, and an analyzer that names the rank that went astray.

    PLAIT_DISTRIBUTED_DEBUG=DETAIL python train.py     # or configure(level="DETAIL")
    plait.debug.dump_flight_recorder()                 # or kill -USR1 <pid>
    plait debug analyze /tmp/plait_trace               # after a hang: who, which op, which line

Names load on first use: `import plait` reads PLAIT_* variables through `config` without
importing torch (see `activate`).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS = {
    "CommCounts": "plait.debug.comm_mode",
    "CommDebugMode": "plait.debug.comm_mode",
    "DebugConfig": "plait.debug.config",
    "WATCHDOG_EXIT_CODE": "plait.debug.config",
    "CollectiveMismatchError": "plait.debug.check",
    "CollectiveTimeoutError": "plait.debug.check",
    "configure": "plait.debug.session",
    "configured": "plait.debug.session",
    "current_config": "plait.debug.session",
    "dump_flight_recorder": "plait.debug.session",
    "summary": "plait.debug.session",
    "analyze": "plait.debug.analyze",
    "bootstrap_dir": "plait.debug.activate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plait.debug' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
