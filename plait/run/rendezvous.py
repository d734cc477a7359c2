"""Multi-node rendezvous over c10d's TCPStore: rounds, last call, late joiners, one end per round.

Keys, under `plait/<run id>/` on the rendezvous store:

    round            the open round r (a counter; bumped r → r+1 by compare-and-set)
    r<r>/joined      how many nodes joined round r; a joiner's index is its add() result
    r<r>/node/<i>    the i-th joiner's NodeInfo
    r<r>/closed      the members (NodeInfo list, group-rank order) and restarts used — set once
    r<r>/done        nodes whose workers all exited 0
    r<r>/end         the RoundEnd — set once, by the first node to see a reason
    hb/<node id>     heartbeat counters (heartbeat.py)

Joining r: once `min` nodes joined, the round closes after `last_call_timeout`, or at once at
`max` (static: at `nnodes`, ordered by --node-rank). A node that joins a closed round waits for
the next one; the members see it in `joined` and regroup (MEMBERSHIP) if there is room. Every
round starts from fresh keys and gets a fresh worker store, so nothing of an attempt leaks into
the next. Every wait is bounded by join_timeout, the heartbeat timeout, or a signal.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

from plait.run.config import LaunchConfig
from plait.run.heartbeat import Liveness
from plait.run.net import ALL_INTERFACES, listen
from plait.run.rounds import EndReason, NodeInfo, RoundEnd, RoundInfo
from plait.run.store import RdzvStore, WorkerStore

_POLL = 0.05
_JOINER_GRACE = 2.0  # a joiner writes its NodeInfo right after taking its index


class RendezvousError(RuntimeError):
    """The rendezvous cannot complete; the message has the counts and the endpoint."""


class JobOver(Exception):
    """The job ended (for good) while this node was waiting to join it."""

    def __init__(self, end: RoundEnd):
        super().__init__(end.detail)
        self.end = end


class StoreRendezvous:
    """One agent's side of the protocol above: join rounds, watch the running one, end it, advance."""

    def __init__(
        self, cfg: LaunchConfig, store: RdzvStore, me: NodeInfo, *,
        sleep: Callable[[float], None], liveness: Liveness, is_host: bool, on_close: Callable[[], None],
    ):
        self._cfg = cfg
        self.is_host = is_host  # this agent serves the rendezvous store: the job ends when it leaves
        self._on_close = on_close
        self._rdzv = cfg.rdzv
        self._store = store
        self._me = me  # worker_port and prev_group_rank are filled in per round
        self._sleep = sleep  # Waker.wait + signal check: returns early, or raises SignalReceived
        self._liveness = liveness
        self._next_liveness_check = 0.0

    # -- joining ---------------------------------------------------------------------------

    def next_round(self, prev: RoundInfo | None) -> tuple[RoundInfo, WorkerStore | None]:
        deadline = time.monotonic() + self._rdzv.join_timeout
        r = self._store.count("round")
        while True:
            joined = self._join(r, prev, deadline)
            if joined is not None:
                return joined
            r = self._wait_for_next_round(r, deadline)

    def _join(self, r: int, prev: RoundInfo | None, deadline: float):
        sock = listen(ALL_INTERFACES, 0, what="worker store")
        me = dataclasses.replace(self._me, worker_port=sock.getsockname()[1],
                                 prev_group_rank=prev.group_rank if prev else None)
        try:
            index = self._store.add(f"r{r}/joined", 1) - 1
            self._store.set(f"r{r}/node/{index}", me.to_json())
            record = json.loads(self._wait_closed(r, prev, deadline))
        except BaseException:
            sock.close()
            raise
        if "error" in record:
            sock.close()
            raise RendezvousError(record["error"])
        nodes = tuple(NodeInfo.from_json(n) for n in record["nodes"])
        ids = [n.node_id for n in nodes]
        if me.node_id not in ids:
            sock.close()
            return None  # too late for round r
        info = RoundInfo(r, ids.index(me.node_id), nodes, record["restarts"])
        if info.group_rank != 0:
            sock.close()
            return info, None
        return info, WorkerStore(sock, me.addr)

    def _wait_closed(self, r: int, prev: RoundInfo | None, deadline: float) -> str:
        lo, hi = self._rdzv.min_nodes, self._rdzv.max_nodes
        last_call_since = None
        while True:
            closed = self._store.peek(f"r{r}/closed")
            if closed is not None:
                return closed
            n = self._store.count(f"r{r}/joined")
            now = time.monotonic()
            ready = n >= hi
            if not ready and n >= lo and self._rdzv.backend == "c10d":
                last_call_since = last_call_since if last_call_since is not None else now
                ready = now - last_call_since >= self._rdzv.last_call_timeout
            if ready:
                return self._close(r, n)
            if now >= deadline:
                raise RendezvousError(
                    f"rendezvous timed out after {self._rdzv.join_timeout:.0f} s: {n} of "
                    f"{lo if lo == hi else f'{lo}-{hi}'} expected nodes joined round {r} at "
                    f"{self._store.endpoint} (run id {self._rdzv.run_id!r})"
                )
            if prev is not None:
                self._fail_if_too_few(r, n, prev)
            self._sleep(_POLL)

    def _joiners(self, r: int, n: int, *, wait: bool) -> list[NodeInfo]:
        out = []
        for i in range(n):
            raw = self._store.peek(f"r{r}/node/{i}")
            give_up = time.monotonic() + (_JOINER_GRACE if wait else 0.0)
            while raw is None and time.monotonic() < give_up:
                self._sleep(0.01)
                raw = self._store.peek(f"r{r}/node/{i}")
            if raw is not None:
                out.append(NodeInfo.from_json(raw))
        return out

    def _close(self, r: int, n: int) -> str:
        joiners = self._joiners(r, n, wait=True)
        if self._rdzv.backend == "static":
            record = self._static_members(joiners)
        else:
            # survivors keep their group ranks; newcomers follow in join order
            order = sorted(range(len(joiners)), key=lambda i: (
                joiners[i].prev_group_rank is None, joiners[i].prev_group_rank or 0, i))
            record = {"nodes": [joiners[i].to_json() for i in order[: self._rdzv.max_nodes]]}
        prev_end = self._store.peek(f"r{r - 1}/end") if r > 0 else None
        record["restarts"] = RoundEnd.from_json(prev_end).restarts if prev_end else 0
        return self._store.put_once(f"r{r}/closed", json.dumps(record))

    def _static_members(self, joiners: list[NodeInfo]) -> dict:
        by_rank: dict[int, list[NodeInfo]] = {}
        for node in joiners:
            by_rank.setdefault(node.node_rank, []).append(node)
        for rank, nodes in sorted(by_rank.items()):
            if len(nodes) > 1:
                names = " and ".join(n.name for n in nodes)
                return {"error": f"static rendezvous: {names} both use --node-rank {rank}"}
        missing = [k for k in range(self._rdzv.max_nodes) if k not in by_rank]
        if missing:
            return {"error": f"static rendezvous: no node joined with --node-rank {missing}"}
        return {"nodes": [by_rank[k][0].to_json() for k in range(self._rdzv.max_nodes)]}

    def _fail_if_too_few(self, r: int, n: int, prev: RoundInfo) -> None:
        """After a restart: exit rather than wait for nodes whose agents are gone."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + self._rdzv.keep_alive_interval / 2
        joined = {node.node_id for node in self._joiners(r, n, wait=False)}
        missing = [m for m in prev.nodes if m.node_id not in joined and m.node_id != self._me.node_id]
        gone = self._liveness.gone([m.node_id for m in missing])
        possible = n + len(missing) - len(gone)
        if gone and possible < self._rdzv.min_nodes:
            lost = ", ".join(f"{m.name} ({gone[m.node_id]})" for m in missing if m.node_id in gone)
            raise RendezvousError(
                f"only {possible} node(s) remain for round {r}, fewer than the minimum of "
                f"{self._rdzv.min_nodes} (--nnodes); lost: {lost}"
            )

    def _wait_for_next_round(self, r: int, deadline: float) -> int:
        """This node joined round r after it closed: wait for r+1, or for the job to end."""
        try:
            while True:
                current = self._store.count("round")
                if current > r:
                    return current
                raw = self._store.peek(f"r{r}/end")
                if raw is not None and RoundEnd.from_json(raw).final:
                    raise JobOver(RoundEnd.from_json(raw))
                if time.monotonic() >= deadline:
                    closed = json.loads(self._store.peek(f"r{r}/closed") or "{}")
                    raise RendezvousError(
                        f"waited {self._rdzv.join_timeout:.0f} s to join: round {r} runs with "
                        f"{len(closed.get('nodes', []))} node(s) (maximum {self._rdzv.max_nodes}) "
                        f"at {self._store.endpoint} and did not restart"
                    )
                self._sleep(_POLL * 4)
        except BaseException:
            self._store.add(f"r{r}/joined", -1)  # no longer waiting: don't make the members regroup
            raise

    # -- while the round runs --------------------------------------------------------------

    def end_round(
        self, info: RoundInfo, reason: EndReason, detail: str, failure: dict | None = None, *, final: bool = False,
    ) -> RoundEnd:
        """Propose how round `info.round` ended; returns the end that was recorded first."""
        end = RoundEnd.decide(
            round=info.round, reason=reason, restarts_before=info.restarts,
            max_restarts=self._cfg.max_restarts, by=info.me.name, detail=detail, failure=failure, final=final,
        )
        return RoundEnd.from_json(self._store.put_once(f"r{info.round}/end", end.to_json()))

    def mark_done(self, info: RoundInfo) -> None:
        self._store.add(f"r{info.round}/done", 1)

    def check_round(self, info: RoundInfo) -> RoundEnd | None:
        """The round's end if it has one, or the end this check found a reason for."""
        r = info.round
        raw = self._store.peek(f"r{r}/end")
        if raw is not None:
            return RoundEnd.from_json(raw)
        done = self._store.count(f"r{r}/done")
        if done == len(info.nodes):
            return self.end_round(info, EndReason.SUCCESS, f"all {info.world_size} workers exited 0")
        now = time.monotonic()
        if now >= self._next_liveness_check:
            self._next_liveness_check = now + self._rdzv.keep_alive_interval / 2
            others = [n for n in info.nodes if n.node_id != info.me.node_id]
            gone = self._liveness.gone([n.node_id for n in others])
            if gone:
                lost = [n for n in others if n.node_id in gone]
                detail = "; ".join(f"node {n.name} (group rank {info.nodes.index(n)}) lost: {gone[n.node_id]}"
                                   for n in lost)
                return self.end_round(info, EndReason.NODE_LOST, detail)
        if done == 0 and len(info.nodes) < self._rdzv.max_nodes:
            waiting = self._store.count(f"r{r}/joined") - len(info.nodes)
            if waiting > 0:
                return self.end_round(info, EndReason.MEMBERSHIP, f"{waiting} more node(s) asked to join")
        return None

    def advance(self, info: RoundInfo) -> None:
        self._store.swap("round", str(info.round), str(info.round + 1))

    def last_round_nodes(self) -> list[str]:
        """Node ids of everyone in (or waiting for) the latest round: whom the host waits for."""
        r = self._store.count("round")
        return [n.node_id for n in self._joiners(r, self._store.count(f"r{r}/joined"), wait=False)]

    def close(self) -> None:
        self._on_close()
