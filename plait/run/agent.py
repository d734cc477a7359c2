"""The agent, one per node: rendezvous, run the workers, watch them, then regroup or finish.

    open rendezvous ──▶ ┌─ next_round ─▶ start workers ─▶ watch ─▶ stop workers ─┐
                        └── restart: a fresh round and worker store ◀─ not final ─┘
                                                 final ─▶ summary ─▶ exit code

Watching a round: a worker failing, a node going quiet, a node asking to join, or every node
finishing each ends the round, and the first node to see it writes the round's one RoundEnd.
Every node then stops its workers (their whole process groups) and follows that end's
decision. The exit code: 0 when every worker of the job exited 0, 1 when the job failed,
128+N after signal N, 2 for a mistake in the invocation (from main()).
"""

from __future__ import annotations

import signal

from plait.run.config import LaunchConfig
from plait.run.errors import Failure, format_failure, format_summary
from plait.run.logs import AgentLog, RunDir
from plait.run.rendezvous import JobOver, RendezvousError
from plait.run.rounds import EndReason, RoundEnd, RoundInfo
from plait.run.session import node_name, open_rendezvous
from plait.run.signals import SignalReceived, SignalWatcher, Waker
from plait.run.store import StoreLost, WorkerStore
from plait.run.workers import WorkerGroup


class Agent:
    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.log = AgentLog()
        if cfg.rdzv.max_nodes > 1:
            self.log.node = node_name(cfg)
        self.waker = Waker()
        self.signals = SignalWatcher(cfg.signals, self.waker)

    def run(self) -> int:
        run_dir = RunDir(self.cfg.logs)
        code = 1
        try:
            with self.signals:
                code = self._run(run_dir)
            return code
        finally:
            run_dir.cleanup(succeeded=code == 0)
            self.waker.close()

    def _sleep(self, seconds: float) -> None:
        self.waker.wait(seconds)
        self.signals.check()

    def _run(self, run_dir: RunDir) -> int:
        try:
            rdzv = open_rendezvous(self.cfg, sleep=self._sleep, interrupt=self.signals.check, say=self.log.info)
        except SignalReceived as s:
            return s.exit_code
        except StoreLost as e:
            self.log.error(str(e))
            return 1
        try:
            return self._rounds(rdzv, run_dir)
        except SignalReceived as s:  # outside a round: no workers to stop
            self.log.info(f"received {signal.Signals(s.signum).name}; no workers were running")
            return s.exit_code
        except (RendezvousError, StoreLost) as e:
            self.log.error(str(e))
            return 1
        finally:
            rdzv.close()

    def _rounds(self, rdzv, run_dir: RunDir) -> int:
        info: RoundInfo | None = None
        while True:
            try:
                info, worker_store = rdzv.next_round(info)
            except JobOver as over:
                if over.end.succeeded:
                    self.log.info("the job finished while this node was waiting to join it")
                    return 0
                self.log.error(f"the job failed while this node was waiting to join it: {over.end.detail}")
                return 1
            self._announce(info)
            group = WorkerGroup(self.cfg, info, run_dir, on_output_closed=self.waker.wake)
            try:
                group.start()
                end, failures = self._watch(rdzv, info, group, worker_store)
            except SignalReceived as s:
                return self._stop_for_signal(rdzv, info, group, s)
            finally:
                group.stop(timeout=self.cfg.shutdown_timeout, hurry=self.signals.hurry)
                if worker_store is not None:
                    worker_store.close()
            if end.succeeded:
                return 0
            if not end.final:
                self._announce_restart(end)
                rdzv.advance(info)
                continue
            self.log.error(self._summary(end, failures))
            return 1

    def _watch(self, rdzv, info: RoundInfo, group: WorkerGroup, worker_store: WorkerStore | None):
        failures: list[Failure] = []
        marked_done = False
        while True:
            self.signals.check()
            new = group.poll()
            if new:
                failures += new
                first = min(new, key=lambda f: f.timestamp)
                return rdzv.end_round(info, EndReason.FAILURE, first.headline(), first.to_json()), failures
            if not marked_done and group.all_succeeded:
                rdzv.mark_done(info)
                marked_done = True
            end = rdzv.check_round(info)
            if end is not None:
                return end, failures
            fds = []
            if worker_store is not None:
                worker_store.serve_if_pending(timeout=self.cfg.rdzv.read_timeout)
                fd = worker_store.fileno()
                fds = [fd] if fd is not None else []
            self.waker.wait(self.cfg.monitor_interval, fds)

    def _stop_for_signal(self, rdzv, info: RoundInfo, group: WorkerGroup, s: SignalReceived) -> int:
        name = signal.Signals(s.signum).name
        group.stop(s.signum, timeout=self.cfg.shutdown_timeout, hurry=self.signals.hurry)
        try:  # the job cannot go on without the store this node serves
            rdzv.end_round(info, EndReason.NODE_LEFT, f"node {info.me.name} received {name}", final=rdzv.is_host)
        except StoreLost:
            pass
        self.log.info(f"received {name}: stopped {len(group.workers)} worker(s)")
        return s.exit_code

    def _announce(self, info: RoundInfo) -> None:
        first, last = info.rank_offset, info.rank_offset + self.cfg.nproc_per_node - 1
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        if self.cfg.rdzv.max_nodes > 1:
            self.log.info(f"round {info.round}: {len(info.nodes)} node(s), world size {info.world_size}; "
                          f"this node is group rank {info.group_rank} with {ranks}")
        else:
            self.log.debug(f"attempt {info.round}: {info.world_size} worker(s)")

    def _announce_restart(self, end: RoundEnd) -> None:
        if end.reason is EndReason.MEMBERSHIP:
            self.log.info(f"regrouping: {end.detail}")
        else:
            self.log.info(f"{end.detail}; restarting every worker (restart {end.restarts} of "
                          f"{self.cfg.max_restarts})")

    def _summary(self, end: RoundEnd, failures: list[Failure]) -> str:
        if end.restarts > self.cfg.max_restarts:
            title = (f"{self.cfg.name} FAILED after {end.round + 1} attempt(s): no restarts left "
                     f"(--max-restarts {self.cfg.max_restarts})")
        else:  # ended for good before the restarts ran out: the node serving the store left
            title = f"{self.cfg.name} stopped: {end.detail}"
        root = format_failure(Failure.from_json(end.failure)) if end.failure else f"  {end.detail}"
        others = [f for f in failures if end.failure is None or f.to_json() != end.failure]
        return "job failed\n" + format_summary(title, root, others)
