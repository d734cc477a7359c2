"""Open this agent's rendezvous for the job, and close it so that no node is left hanging.

    --nnodes 1 (max 1)  ──▶ LocalRendezvous: rounds counted in memory; no store, no torch import
    --nnodes > 1        ──▶ StoreRendezvous on the job's TCPStore:
                              static: --node-rank 0 serves it on --master-addr:--master-port
                              c10d:   the first agent on the endpoint's host that binds the port
                              serves it; every other agent connects (bounded by join_timeout)

The agent that serves the rendezvous store outlives the job by a little: on close it waits (up
to close_timeout) until every other node has said goodbye or stopped heartbeating, so nobody
loses the store while reading how the job ended.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from collections.abc import Callable

from plait.run import store as stores
from plait.run.config import LaunchConfig
from plait.run.heartbeat import Heartbeat, Liveness
from plait.run.net import (
    ALL_INTERFACES,
    PortInUse,
    format_endpoint,
    is_local_address,
    listen,
    route_address,
)
from plait.run.rendezvous import StoreRendezvous
from plait.run.rounds import EndReason, NodeInfo, RoundEnd, RoundInfo
from plait.run.store import RdzvStore, WorkerStore

_BUSY_PORT_CONNECT_TIMEOUT = 10.0  # a fellow agent holding the port answers in milliseconds


class LocalRendezvous:
    """One node: a round is just a counter, and the worker store listens on --master-addr."""

    is_host = True

    def __init__(self, cfg: LaunchConfig, me: NodeInfo):
        self._cfg = cfg
        self._me = me
        self._round = 0
        self._restarts = 0
        self._ends: dict[int, RoundEnd] = {}
        self._done: set[int] = set()

    def next_round(self, prev: RoundInfo | None) -> tuple[RoundInfo, WorkerStore]:
        cfg = self._cfg
        what = f"--master-port {format_endpoint(cfg.master_addr, cfg.master_port)}" if cfg.master_port else "worker store"
        sock = listen(cfg.master_addr, cfg.master_port or 0, what=what)
        me = dataclasses.replace(self._me, worker_port=sock.getsockname()[1],
                                 prev_group_rank=0 if prev else None)
        return RoundInfo(self._round, 0, (me,), self._restarts), WorkerStore(sock, cfg.master_addr)

    def end_round(self, info: RoundInfo, reason: EndReason, detail: str, failure: dict | None = None,
                  *, final: bool = False) -> RoundEnd:
        if info.round not in self._ends:
            self._ends[info.round] = RoundEnd.decide(
                round=info.round, reason=reason, restarts_before=info.restarts,
                max_restarts=self._cfg.max_restarts, by=info.me.name, detail=detail, failure=failure, final=final,
            )
        return self._ends[info.round]

    def mark_done(self, info: RoundInfo) -> None:
        self._done.add(info.round)

    def check_round(self, info: RoundInfo) -> RoundEnd | None:
        if info.round in self._done and info.round not in self._ends:
            self.end_round(info, EndReason.SUCCESS, f"all {info.world_size} workers exited 0")
        return self._ends.get(info.round)

    def advance(self, info: RoundInfo) -> None:
        self._restarts = self._ends[info.round].restarts
        self._round = info.round + 1

    def close(self) -> None:
        pass


def node_name(cfg: LaunchConfig) -> str:
    """How people see this node in prefixes and messages: --local-addr, else the host name."""
    return cfg.rdzv.local_addr or socket.gethostname()


def _me(cfg: LaunchConfig, addr: str) -> NodeInfo:
    host = socket.gethostname()
    return NodeInfo(
        node_id=f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}", name=node_name(cfg),
        addr=addr, nproc=cfg.nproc_per_node, node_rank=cfg.rdzv.node_rank, prev_group_rank=None, worker_port=0,
    )


def open_rendezvous(
    cfg: LaunchConfig, *, sleep: Callable[[float], None], interrupt: Callable[[], None], say: Callable[[str], None],
) -> LocalRendezvous | StoreRendezvous:
    r = cfg.rdzv
    if r.single_node:
        return LocalRendezvous(cfg, _me(cfg, cfg.master_addr))

    flag = "--rdzv-endpoint" if r.backend == "c10d" else "--master-addr/--master-port"
    want_host = r.is_host if r.is_host is not None else (
        r.node_rank == 0 if r.backend == "static" else is_local_address(r.host))
    sock, port, connect_timeout = None, r.port, r.join_timeout
    if want_host:
        try:  # bind before importing torch: a port conflict is reported at once
            sock = listen(ALL_INTERFACES, r.port, what=f"{flag} {format_endpoint(r.host, r.port)}")
        except PortInUse:
            if r.backend == "static" or r.is_host:
                raise
            # another agent on this machine serves the store: it answers in milliseconds
            connect_timeout = min(connect_timeout, _BUSY_PORT_CONNECT_TIMEOUT)
    stores.load_torch()
    server = None
    if sock is not None:  # agents connecting meanwhile wait in the listen backlog
        server = stores.serve(sock, timeout=r.read_timeout)
        port = server.port
        say(f"serving the rendezvous store at {format_endpoint(r.host, port)}")

    def client():
        return stores.connect(r.host, port, timeout=connect_timeout, op_timeout=r.read_timeout, interrupt=interrupt)

    endpoint = format_endpoint(r.host, port)
    main = RdzvStore(server if server is not None else client(), run_id=r.run_id, endpoint=endpoint)
    beats = RdzvStore(client(), run_id=r.run_id, endpoint=endpoint)
    me = _me(cfg, r.local_addr or route_address(r.host, port))
    heartbeat = Heartbeat(beats, me.node_id, r.keep_alive_interval)
    liveness = Liveness(main, r.heartbeat_timeout)

    def close() -> None:
        heartbeat.stop(gone=True)
        if server is None:
            return
        deadline = time.monotonic() + r.close_timeout
        try:
            others = [n for n in rdzv.last_round_nodes() if n != me.node_id]
            while others and time.monotonic() < deadline:
                gone = liveness.gone(others)
                others = [n for n in others if n not in gone]
                time.sleep(0.05)
        except stores.StoreLost:
            pass

    rdzv = StoreRendezvous(cfg, main, me, sleep=sleep, liveness=liveness, is_host=server is not None, on_close=close)
    return rdzv
