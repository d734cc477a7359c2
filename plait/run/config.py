"""What `plait run` was asked to do, as one frozen, already-checked `LaunchConfig`.

    argv ──args.parse_config──▶ LaunchConfig ──agent.run──▶ exit code

Every user mistake (`--nproc-per-node 0`, `--nnodes 2:1`, an endpoint that does not parse, a
script that does not exist) is raised here as `LaunchError`, naming the flag and the value,
before any socket or process exists. The parsers are plain functions so tests can call them.
"""

from __future__ import annotations

import enum
import os
import re
import signal
from dataclasses import dataclass


class LaunchError(ValueError):
    """A mistake in how `plait run` was invoked; the message says which flag and value."""


class Std(enum.IntFlag):
    """Which of a worker's streams a `--redirects`/`--tee` value covers (torchrun's 0/1/2/3)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class StdSpec:
    """A `--redirects`/`--tee` value: one Std for every local rank, or one per listed local rank."""

    default: Std = Std.NONE
    per_rank: tuple[tuple[int, Std], ...] = ()

    def for_rank(self, local_rank: int) -> Std:
        return dict(self.per_rank).get(local_rank, self.default)


def parse_std(flag: str, text: str) -> StdSpec:
    """`3` → every rank both streams; `0:1,1:2` → local rank 0 stdout, local rank 1 stderr."""
    text = text.strip()

    def std(value: str) -> Std:
        if value.strip() not in ("0", "1", "2", "3"):
            raise ValueError(value)
        return Std(int(value))

    try:
        if ":" not in text:
            return StdSpec(default=std(text or "0"))
        pairs = []
        for item in text.split(","):
            rank, value = item.split(":")
            pairs.append((int(rank), std(value)))
        return StdSpec(per_rank=tuple(pairs))
    except ValueError:
        raise LaunchError(
            f"{flag} {text!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
            f"or LOCAL_RANK:VALUE pairs such as 0:1,1:2"
        ) from None


def parse_nnodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` → (min_nodes, max_nodes)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if not m:
        raise LaunchError(f"--nnodes {text!r}: expected a node count N or a range MIN:MAX")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise LaunchError(f"--nnodes {text}: the minimum number of nodes ({lo}) must be at least 1")
    if hi < lo:
        raise LaunchError(f"--nnodes {text}: the minimum ({lo}) is larger than the maximum ({hi})")
    return lo, hi


def parse_nproc(text: str) -> int:
    """An int, or `cpu` (one per core), `gpu`/`xpu` (one per device), `auto` (devices, else cores)."""
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        n = int(text)
        if n < 1:
            raise LaunchError(f"--nproc-per-node {n}: a node needs at least 1 worker")
        return n
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "xpu", "auto"):
        import torch  # only this choice needs torch, to count devices

        if text == "auto":
            if torch.accelerator.is_available():
                return torch.accelerator.device_count()
            return os.cpu_count() or 1
        module = torch.cuda if text == "gpu" else torch.xpu
        if not module.is_available() or module.device_count() == 0:
            raise LaunchError(f"--nproc-per-node {text}: no {text.upper()} is available on this machine")
        return module.device_count()
    raise LaunchError(f"--nproc-per-node {text!r}: expected a positive integer, cpu, gpu, xpu or auto")


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not text.strip():
        return None
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise LaunchError(
            f"--local-ranks-filter {text!r}: expected comma-separated local ranks, e.g. 0,1,2"
        ) from None
    return ranks


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    out = []
    for name in filter(None, (s.strip().upper() for s in text.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        try:
            out.append(signal.Signals[name])
        except KeyError:
            raise LaunchError(f"--signals-to-handle: unknown signal {name!r}") from None
        if out[-1] in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise LaunchError(f"--signals-to-handle: {name} cannot be handled")
    return tuple(out)


# torchrun's --rdzv-conf keys (and their defaults, in seconds) that plait implements.
RDZV_CONF_DEFAULTS: dict[str, float] = {
    "join_timeout": 600.0,
    "last_call_timeout": 30.0,
    "close_timeout": 30.0,
    "timeout": 60.0,  # one store operation; torchrun calls it read_timeout too
    "keep_alive_interval": 5.0,
    "keep_alive_max_attempt": 3,
}
_RDZV_CONF_ALIASES = {"read_timeout": "timeout"}
_RDZV_CONF_IGNORED = {"use_libuv", "store_type"}  # accepted for torchrun recipes, no effect here


def parse_rdzv_conf(text: str) -> tuple[dict[str, float], bool | None]:
    """`join_timeout=60,last_call_timeout=5,is_host=1` → (timeouts, is_host)."""
    conf = dict(RDZV_CONF_DEFAULTS)
    is_host = None
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = _RDZV_CONF_ALIASES.get(key.strip(), key.strip())
        if not sep:
            raise LaunchError(f"--rdzv-conf {item!r}: expected KEY=VALUE")
        if key in _RDZV_CONF_IGNORED:
            continue
        if key == "is_host":
            is_host = value.strip().lower() in ("1", "true", "yes")
            continue
        if key not in conf:
            known = ", ".join(sorted([*conf, "is_host"]))
            raise LaunchError(f"--rdzv-conf: unknown key {key!r} (known: {known})")
        try:
            number = float(value)
        except ValueError:
            raise LaunchError(f"--rdzv-conf {key}={value!r}: expected a number of seconds") from None
        if number <= 0:
            raise LaunchError(f"--rdzv-conf {key}={value}: must be positive")
        conf[key] = number
    return conf, is_host


@dataclass(frozen=True)
class RendezvousConfig:
    backend: str  # "c10d" (elastic, nodes join in any order) or "static" (fixed --node-rank)
    host: str  # c10d: the endpoint's host; static: --master-addr
    port: int  # 0: any free port (standalone)
    run_id: str
    min_nodes: int
    max_nodes: int
    node_rank: int  # static only
    local_addr: str | None
    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    read_timeout: float
    keep_alive_interval: float
    keep_alive_max_attempt: int
    is_host: bool | None

    @property
    def single_node(self) -> bool:
        """A job that can never have a second node needs no rendezvous store at all."""
        return self.max_nodes == 1

    @property
    def heartbeat_timeout(self) -> float:
        return self.keep_alive_interval * self.keep_alive_max_attempt


@dataclass(frozen=True)
class LogConfig:
    log_dir: str | None
    redirects: StdSpec
    tee: StdSpec
    local_ranks_filter: frozenset[int] | None
    prefix_template: str | None  # None: "[rank R] ", with the node's name when nnodes > 1


@dataclass(frozen=True)
class LaunchConfig:
    rdzv: RendezvousConfig
    logs: LogConfig
    nproc_per_node: int
    max_restarts: int
    monitor_interval: float
    shutdown_timeout: float  # SIGTERM → SIGKILL grace for each worker's process group
    role: str
    command: tuple[str, ...]  # what every worker execs; per-rank values come through the env
    name: str  # the script or module, for messages ("train.py FAILED")
    master_addr: str  # single node: where this round's worker store listens
    master_port: int | None  # single node: None picks a free port each attempt
    signals: tuple[signal.Signals, ...]
    virtual_local_rank: bool
