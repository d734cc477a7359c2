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
