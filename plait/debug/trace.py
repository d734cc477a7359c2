"""What a rank says about its ops: one log line per op (DETAIL), a summary at exit (INFO).

    on_end(entry) -> OpLog: "rank 0 | group 0 [0, 1] #12 all_reduce(sum) (4, 8) float32 | 0.153 ms | train.py:42"
                  -> Summary: (group, op) -> count, bytes sent, seconds
    exit -> Summary.text(): a few lines per group, busiest op first

Lines go to the `plait.debug` logger; when nobody has configured it, to stderr with a
`[plait.debug]` prefix, so a launcher's per-rank log prefix stays readable.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass

from plait.debug.callsite import format_site
from plait.debug.fingerprint import describe
from plait.debug.recorder import Entry

logger = logging.getLogger("plait.debug")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (a harness may redirect it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: ANN201 - logging's attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def ensure_handler() -> None:
    """Log to stderr at INFO unless the application configured `plait.debug` logging."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[plait.debug] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


def format_entry(entry: Entry) -> str:
    d = entry.to_dict()
    where = f"{d['op']} #{d['seq']}" if not d["p2p"] else f"{d['op']} #{d['seq']} ({'to' if d['op'] == 'send' else 'from'} {d['peer_global']})"
    duration = "" if d["duration_ms"] is None else f" | {d['duration_ms']:.3f} ms"
    return (f"rank {d['global_rank']} | group {d['group']} {d['group_ranks']} {where} {describe(d)}"
            f"{duration} | {format_site(d['site'])}")


def log_entry(entry: Entry) -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info(format_entry(entry))


@dataclass
class _Tally:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Summary:
    """Per-rank totals by group and op."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tallies: dict[tuple[str, str], _Tally] = defaultdict(_Tally)
        self._ranks: dict[str, tuple[int, ...]] = {}

    def add(self, entry: Entry) -> None:
        seconds = 0.0 if entry.t_completed is None else (entry.t_completed - entry.t_scheduled) / 1e9
        with self._lock:
            tally = self._tallies[(entry.group, entry.op)]
            tally.count += 1
            tally.bytes += entry.bytes
            tally.seconds += seconds
            self._ranks[entry.group] = entry.group_ranks

    def totals(self) -> dict[str, dict[str, dict]]:
        """group -> op -> {"count", "bytes", "seconds"}."""
        with self._lock:
            out: dict[str, dict[str, dict]] = {}
            for (group, op), t in self._tallies.items():
                out.setdefault(group, {})[op] = {"count": t.count, "bytes": t.bytes, "seconds": t.seconds}
            return out

    def text(self, rank: int) -> str:
        totals = self.totals()
        if not totals:
            return f"rank {rank}: no collective or p2p ops"
        n = sum(t["count"] for ops in totals.values() for t in ops.values())
        lines = [f"rank {rank}: {n} ops"]
        for group in sorted(totals):
            ops = totals[group]
            lines.append(f"  group {group} {list(self._ranks[group])}:")
            for op, t in sorted(ops.items(), key=lambda kv: -kv[1]["count"]):
                lines.append(f"    {op:<15} x{t['count']:<7} {_human(t['bytes']):>10} sent  {t['seconds']:.3f} s")
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
