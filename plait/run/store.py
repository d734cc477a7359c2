"""c10d's TCPStore as the launcher uses it: served on a socket we bound, reached with a bound.

    rendezvous store (one per job, multi-node only): hosted by the agent on the endpoint's host
        agents ──RdzvStore (PrefixStore "plait/<run id>/")──▶ rounds, heartbeats, end records
    worker store (one per round): hosted by group rank 0's agent on the socket it bound at join
        workers ──init_process_group(env://), TORCHELASTIC_USE_AGENT_STORE=True──▶ MASTER_ADDR:MASTER_PORT

A fresh worker store per round is what makes restarts work with a real process group: the
restarted ranks cannot read the previous attempt's peer addresses (pytorch#135712), because
those keys lived in a server that no longer exists.

torch is imported here, and only on first use: a single-node agent imports it when its first
worker connects to the worker store, so jobs that never touch torch.distributed (and the
launcher's own start) don't pay the ~1.5 s import.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from datetime import timedelta

from plait.run.net import format_endpoint


class StoreLost(RuntimeError):
    """The rendezvous store stopped answering: its host agent exited, or the network is down."""


def _dist():
    import torch.distributed as dist  # lazy: see the module docstring

    return dist


def load_torch() -> None:
    _dist()


def serve(sock: socket.socket, *, timeout: float):
    """Start a TCPStore server on the already-listening `sock` (the store takes the fd over)."""
    host, port = sock.getsockname()[:2]
    store = _dist().TCPStore(
        host, port, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout), master_listen_fd=sock.fileno(),
    )
    sock.detach()
    return store


def connect(host: str, port: int, *, timeout: float, op_timeout: float, interrupt) -> object:
    """A TCPStore client for host:port, waiting at most `timeout` seconds for the server.

    The TCPStore constructor can block past its own timeout (a listening socket that is not a
    store never answers its handshake), so it runs in a daemon thread and we wait on it here,
    calling `interrupt()` (which may raise, e.g. on a signal) every 50 ms.
    """
    result: dict[str, object] = {}

    def _connect():
        try:
            result["store"] = _dist().TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception as e:  # reported by the waiting thread
            result["error"] = e

    thread = threading.Thread(target=_connect, name="plait-store-connect", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout + 1.0  # past the constructor's own timeout
    while thread.is_alive() and time.monotonic() < deadline:
        interrupt()
        thread.join(0.05)
    where = format_endpoint(host, port)
    if "store" in result:
        store = result["store"]
        store.set_timeout(timedelta(seconds=op_timeout))
        return store
    if "error" in result:
        first = str(result["error"]).strip().splitlines()[0] if str(result["error"]).strip() else ""
        raise StoreLost(f"could not reach the rendezvous store at {where} within {timeout:.0f} s ({first})")
    raise StoreLost(f"{where} accepted a connection but never answered as a c10d store "
                    f"(is another program using that port?)")


_MISSING = "\0plait:missing"


class RdzvStore:
    """The job's keys on the rendezvous store; any failing operation raises StoreLost."""

    def __init__(self, store, *, run_id: str, endpoint: str):
        self._store = _dist().PrefixStore(f"plait/{run_id}/", store)
        self.endpoint = endpoint

    def _call(self, op, *args):
        try:
            return op(*args)
        except Exception as e:  # DistStoreError, DistNetworkError, RuntimeError from c10d
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreLost(f"lost the rendezvous store at {self.endpoint}: {first}") from None

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._store.add, key, amount))

    def count(self, key: str) -> int:
        return self.add(key, 0)

    def set(self, key: str, value: str) -> None:
        self._call(self._store.set, key, value)

    def peek(self, key: str) -> str | None:
        """The value, or None if the key does not exist — without blocking as `get` would.

        compare_set with a non-empty expected value never creates a missing key; it returns the
        expected value instead, which we read as "missing".
        """
        value = self._call(self._store.compare_set, key, _MISSING, _MISSING).decode()
        return None if value == _MISSING else value

    def put_once(self, key: str, value: str) -> str:
        """Set `key` unless it exists; return what it holds afterwards (ours, or the first writer's)."""
        return self._call(self._store.compare_set, key, "", value).decode()

    def swap(self, key: str, expected: str, desired: str) -> str:
        return self._call(self._store.compare_set, key, expected, desired).decode()


class WorkerStore:
    """The TCPStore one round's workers meet on, served from the first connection to its socket."""

    def __init__(self, sock: socket.socket, advertised_addr: str):
        self._sock: socket.socket | None = sock
        self._store = None
        self.addr = advertised_addr
        self.port: int = sock.getsockname()[1]

    def fileno(self) -> int | None:
        """The socket to watch while the store is not served yet (None once it is, or closed)."""
        return self._sock.fileno() if self._sock is not None else None

    # Served on demand, so the agent's torch import follows the workers' own instead of overlapping
    # it: ~0.5 s on a quiet machine, once ~60 s under ci-under-load -j 2 (autogroup starves a
    # process in its own session). Importing in a background thread at worker start would overlap
    # them, but costs every job that never connects 1.47 s of CPU and 210 MB RSS (torch 2.13), and
    # lets an exiting agent call exit() while that thread is still loading torch's libraries.
    def serve_if_pending(self, timeout: float) -> bool:
        """Start the server if a worker is waiting to connect; True if it started now."""
        if self._sock is None:
            return False
        readable, _, _ = select.select([self._sock], [], [], 0)
        if not readable:
            return False
        sock, self._sock = self._sock, None
        self._store = serve(sock, timeout=timeout)
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._store = None  # dropping the last reference stops the server and closes its fd
