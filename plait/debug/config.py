"""What to debug: one frozen `DebugConfig`, read from the environment or set by `configure()`.

    PLAIT_* env -> DebugConfig.from_env() -> session.apply(config) -> listener, wrappers, watchdog
    configure(level="DETAIL", timeout=5) -> the current config with those fields replaced

The invariant: every switch that costs something at run time is derived here from the
config (`wants_*`), so OFF is one place, and this module imports nothing but the standard
library — `import plait` reads the environment without importing torch.

| variable                    | default                | meaning                                          |
|-----------------------------|------------------------|--------------------------------------------------|
| PLAIT_DISTRIBUTED_DEBUG     | OFF                    | OFF, INFO (summary at exit), DETAIL (log + check)|
| PLAIT_DESYNC_DEBUG          | 0                      | 1: watchdog + desync report without DETAIL      |
| PLAIT_COLLECTIVE_TIMEOUT    | the group's timeout    | seconds an op may take before the watchdog fires |
| PLAIT_TRACE_BUFFER_SIZE     | 2000                   | flight-recorder ring size per rank; 0 turns it off |
| PLAIT_TRACE_STACKS          | 0                      | 1: record the Python stack of every op           |
| PLAIT_TRACE_DIR             | $TMPDIR/plait_trace    | where dumps (one JSON per rank) are written       |
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

LEVELS = ("OFF", "INFO", "DETAIL")
DEFAULT_BUFFER_SIZE = 2000
WATCHDOG_EXIT_CODE = 124  # what timeout(1) exits with: "it timed out", for the launcher to see
DUMP_FORMAT, DUMP_VERSION = "plait-flight-recorder", 1  # what a dump file says it holds

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def default_trace_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "plait_trace")


@dataclass(frozen=True)
class DebugConfig:
    level: str = "OFF"
    desync: bool = False
    timeout_s: float | None = None  # None: each group's own timeout
    buffer_size: int = DEFAULT_BUFFER_SIZE
    stacks: bool = False
    trace_dir: str = dataclasses.field(default_factory=default_trace_dir)

    def __post_init__(self) -> None:
        level = str(self.level).upper()
        if level not in LEVELS:
            raise ValueError(f"debug level {self.level!r} is not one of {', '.join(LEVELS)}")
        object.__setattr__(self, "level", level)
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"collective timeout must be > 0 seconds, got {self.timeout_s}")
        if self.buffer_size < 0:
            raise ValueError(f"trace buffer size must be >= 0, got {self.buffer_size}")

    @property
    def wants_recorder(self) -> bool:
        return self.buffer_size > 0

    @property
    def wants_check(self) -> bool:
        """Compare fingerprints across the group before every collective."""
        return self.level == "DETAIL"

    @property
    def wants_log(self) -> bool:
        """Log every op as it completes."""
        return self.level == "DETAIL"

    @property
    def wants_summary(self) -> bool:
        return self.level in ("INFO", "DETAIL")

    @property
    def wants_watchdog(self) -> bool:
        return self.desync or self.level == "DETAIL"

    @property
    def wants_wrap(self) -> bool:
        """Route user calls to torch.distributed through the same machinery."""
        return self.level != "OFF" or self.desync

    @property
    def wants_listener(self) -> bool:
        return self.wants_recorder or self.wants_summary or self.wants_watchdog

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> DebugConfig:
        env = os.environ if env is None else env
        timeout = env.get("PLAIT_COLLECTIVE_TIMEOUT", "").strip()
        return DebugConfig(
            level=env.get("PLAIT_DISTRIBUTED_DEBUG", "OFF").strip() or "OFF",
            desync=_flag(env, "PLAIT_DESYNC_DEBUG"),
            timeout_s=_number(timeout, "PLAIT_COLLECTIVE_TIMEOUT", float) if timeout else None,
            buffer_size=_number(env.get("PLAIT_TRACE_BUFFER_SIZE", "").strip() or str(DEFAULT_BUFFER_SIZE),
                                "PLAIT_TRACE_BUFFER_SIZE", int),
            stacks=_flag(env, "PLAIT_TRACE_STACKS"),
            trace_dir=env.get("PLAIT_TRACE_DIR", "").strip() or default_trace_dir(),
        )

    def replace(self, **overrides: object) -> DebugConfig:
        renamed = {"timeout_s" if k == "timeout" else k: v for k, v in overrides.items()}
        unknown = sorted(set(renamed) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown debug setting(s) {unknown}")
        return dataclasses.replace(self, **renamed)


def env_asks_for_debugging(env: Mapping[str, str] | None = None) -> bool:
    """True when the environment turns on more than the default flight recorder (cheap:
    `import plait` calls it and imports the rest only when it says yes)."""
    env = os.environ if env is None else env
    level = env.get("PLAIT_DISTRIBUTED_DEBUG", "").strip().upper()
    return level not in ("", "OFF") or _flag(env, "PLAIT_DESYNC_DEBUG")


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={env[name]!r} is not 0 or 1")


def _number(value: str, name: str, kind: type) -> float | int:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a{'n integer' if kind is int else ' number'}") from None
