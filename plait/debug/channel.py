"""The side channel ranks use to compare notes: the default group's c10d store, under a
`plait_debug/` prefix. Never a transport of our own, and every wait is bounded.

    _get_default_store() -> PrefixStore("plait_debug", store) -> clone() per concurrent user

A c10d store client serializes its calls (a blocking `wait` on one client stalls every
other call on it), so each thread that is using the channel borrows its own clone: the
consistency check on a training thread never delays the watchdog's polling. Clones are
pooled and never destroyed — a FileStore counts destroyed instances towards deleting its
file, and that must stay the job's decision, not ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

PREFIX = "plait_debug"
_lock = threading.Lock()
_root: tuple[object, dist.Store] | None = None  # (the default store it was made from, prefixed store)
_free: list[dist.Store] = []
_kept: list[dist.Store] = []  # every clone ever made, so none is destroyed before the process ends


def _prefixed() -> dist.Store | None:
    global _root
    if not dist.is_initialized():  # after destroy_process_group: the job's store, if we saw it
        return None if _root is None else _root[1]
    base = c10d._get_default_store()
    with _lock:
        if _root is None or _root[0] is not base:
            _root = (base, dist.PrefixStore(PREFIX, base))
            _free.clear()  # clones of an older default store talk to a job that is gone
        return _root[1]


def available() -> bool:
    return _prefixed() is not None


@contextlib.contextmanager
def store() -> Iterator[dist.Store]:
    """Borrow a store client of the channel for the duration of the block."""
    root = _prefixed()
    if root is None:
        raise RuntimeError("plait.debug's side channel needs an initialized default process group")
    with _lock:
        client = _free.pop() if _free else None
    if client is None:
        client = root.clone()
        _kept.append(client)
    try:
        yield client
    finally:
        with _lock:
            if _root is not None and _root[1] is root:
                _free.append(client)


def forget() -> None:
    """Drop every client (in a forked child: they share the parent's connections)."""
    global _root
    with _lock:
        _root = None
        _free.clear()


def hosts_store() -> bool:
    """Whether this process serves the job's store: a TCPStore whose port this process listens on
    (rank 0 under a hand-made env:// launch; nobody under plait run or torchrun, whose agent
    serves it). The store ends with its host's process, so the host must not leave first."""
    base = _root[0] if _root is not None else None
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if not isinstance(base, dist.TCPStore):
        return False  # a FileStore or HashStore outlives (or never crosses) the process
    try:
        return _listening_here(base.port)
    except OSError:  # no /proc: a hand-made env:// launch serves it from rank 0
        return os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _listening_here(port: int) -> bool:
    """Linux: a listening socket on `port` (from /proc/net/tcp*) held by one of our fds."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(fields[9])
    if not inodes:
        return False
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def wait(client: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Wait until every key exists; False when `timeout_s` passes first."""
    if not keys:
        return True
    try:
        client.wait(keys, timedelta(seconds=max(timeout_s, 0.001)))
        return True
    except (dist.DistStoreError, RuntimeError) as e:
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            return False
        raise


def put_json(client: dist.Store, key: str, value: object) -> None:
    client.set(key, json.dumps(value, default=str))


def get_json(client: dist.Store, keys: list[str]) -> list[object]:
    return [json.loads(v) for v in client.multi_get(keys)] if keys else []


def present(client: dist.Store, keys: list[str]) -> list[bool]:
    return [client.check([k]) for k in keys]
