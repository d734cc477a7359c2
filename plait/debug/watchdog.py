"""The watchdog: an op that outlives its timeout ends the job, with a report that names who.

    enter(op) -> in flight, deadline = issued + timeout -> leave(op) at completion
    thread, every poll_s: an op whose Work is done -> completed (even if nobody waited yet)
                          an op past its deadline  -> fire()
                          a peer asked for states  -> respond()
    fire():    publish my state and claim the report (store key desync/request): the first
               rank to claim gathers every rank's state (bounded), decides the verdict and
               publishes it; a rank that timed out too prints that verdict. Dump the flight
               recorder, wait (bounded) until the peers have read what they need, exit 124
    respond(): publish my state and stacks, dump my flight recorder, wait (bounded) for the
               report and for the peers, exit 124 — the whole job stops, each rank leaving
               its dump, so the launcher can restart it  (the round: report_round.py)

States travel through the side channel (the c10d store); a rank that exits normally
publishes its last state first, so a report can say "rank 1 exited after all_reduce #4".
Everything here is best effort: a dead store degrades the report, never hangs it.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch.distributed import distributed_c10d as c10d

from plait.comm.events import CommEvent
from plait.debug import channel, desync
from plait.debug import dump as dumps
from plait.debug import report_round as rounds
from plait.debug.callsite import thread_stacks
from plait.debug.config import WATCHDOG_EXIT_CODE
from plait.debug.recorder import Entry

REPORT_WAIT_MIN_S = 3.0  # a live peer answers within a poll; this is for a loaded machine
REPORT_WAIT_MAX_S = 10.0


def group_timeout_s(name: str) -> float:
    """The timeout the process group `name` was created with."""
    try:
        pg = c10d._resolve_process_group(name)
    except Exception:  # noqa: BLE001 - a group c10d no longer knows
        pg = None
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no backend for that device, or no such option
            continue
    return float(os.environ.get("PLAIT_TIMEOUT", 600))


class Watchdog:
    def __init__(self, *, timeout_s: float | None, dump: Callable[[str, dict], str | None],
                 hints: Callable[[str, tuple[int, ...]], list[str]], trace_dir: str) -> None:
        self.timeout_s = timeout_s
        self.poll_s = min(0.5, max(0.05, (timeout_s or 600.0) / 20))
        # how long the reporter waits for states, a follower for the report, a rank for its peers
        # to finish reading: each wait ends as soon as what it waits for is there, so the bounds
        # only cost time when a rank is dead, and they are generous for a loaded machine
        self.report_wait_s = min(REPORT_WAIT_MAX_S, max(REPORT_WAIT_MIN_S, 1.0 + 10 * self.poll_s))
        self.follow_wait_s = 2 * self.report_wait_s + 2 * self.poll_s
        self.leave_wait_s = self.follow_wait_s
        self.round_s = self.report_wait_s + self.follow_wait_s + self.leave_wait_s  # the longest a report takes
        self._dump, self._hints, self._trace_dir = dump, hints, trace_dir
        self._in_flight: dict[int, tuple[CommEvent, Entry, int]] = {}
        self._last_entered: dict[str, Entry] = {}
        self._last_completed: dict[str, Entry] = {}
        self._timeouts: dict[str, float] = {}
        self._firing = threading.Lock()
        self._stop = threading.Event()
        self._born_ns = time.time_ns()
        self._thread: threading.Thread | None = None

    # -- the training thread's side -------------------------------------------------------
    def timeout_for(self, group: str) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        if group not in self._timeouts:
            self._timeouts[group] = group_timeout_s(group)
        return self._timeouts[group]

    def enter(self, event: CommEvent, entry: Entry) -> None:
        deadline = event.start_ns + int(self.timeout_for(event.group_name) * 1e9)
        self._in_flight[id(entry)] = (event, entry, deadline)
        self._last_entered[entry.group] = entry

    def leave(self, entry: Entry, *, completed: bool = True) -> None:
        if self._in_flight.pop(id(entry), None) is not None and completed:
            self._last_completed[entry.group] = entry

    def wait_if_reporting(self) -> None:
        """Block while this rank reports or answers a report (which ends the process):
        a collective failing on the main thread meanwhile must not cut the report short."""
        if self._firing.locked():
            self._stop.wait(self.round_s + 10.0)

    def oldest_in_flight(self) -> Entry | None:
        entries = [entry for _, entry, _ in list(self._in_flight.values())]
        return min(entries, key=lambda e: e.t_scheduled) if entries else None

    # -- the watchdog thread ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plait-debug-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._scan()
                self._poll_requests()
            except Exception as e:  # noqa: BLE001 - the watchdog must outlive a bad poll
                sys.stderr.write(f"plait.debug watchdog: poll failed: {type(e).__name__}: {e}\n")

    def _scan(self) -> None:
        now = time.perf_counter_ns()
        for event, entry, deadline in list(self._in_flight.values()):
            work = event.work
            if work is not None and work.is_completed():
                entry.completed()
                self.leave(entry)
            elif now >= deadline:
                waited = (now - event.start_ns) / 1e9
                self.fire(entry, f"{entry.op} #{entry.seq} on group {entry.group} did not complete "
                                 f"within {self.timeout_for(entry.group):.1f} s (waited {waited:.1f} s)")

    def _poll_requests(self) -> None:
        if not channel.available():
            return
        with channel.store() as store:
            request = rounds.pending_request(store, born_ns=self._born_ns)
        if request is not None and request["rank"] != dumps.global_rank():
            self._respond(request)

    # -- reporting --------------------------------------------------------------------------
    def state(self, status: str, error: str | None = None) -> dict:
        """This rank's story, for the other ranks' reports."""
        groups = dumps.groups()
        for name, info in groups.items():
            entered, completed = self._last_entered.get(name), self._last_completed.get(name)
            info["last_entered"] = entered.to_dict() if entered else None
            info["last_completed"] = completed.to_dict() if completed else None
        in_flight = sorted((e for _, e, _ in list(self._in_flight.values())), key=lambda e: e.t_scheduled)
        if status == desync.RUNNING and in_flight:
            status = desync.IN_OP
        return {
            "rank": dumps.global_rank(), "pid": os.getpid(), "host": socket.gethostname(), "status": status,
            "error": error, "time_ns": time.time_ns(), "groups": groups,
            "in_flight": [e.to_dict() for e in in_flight],
            "threads": thread_stacks() if status in (desync.RUNNING, desync.IN_OP) else {},
        }

    def publish(self, status: str, error: str | None = None) -> None:
        """Leave this rank's state in the store (at exit, or after a failure)."""
        try:
            if channel.available():
                with channel.store() as store:
                    channel.put_json(store, f"state/{dumps.global_rank()}", self.state(status, error))
        except Exception:  # noqa: BLE001 - the job is ending; a missing state only thins a report
            pass

    def fire(self, entry: Entry, reason: str, *, exit: bool = True) -> str | None:
        """Report `entry` as stuck (see report_round.py): the first rank to get here gathers
        every rank's state and decides; a rank that gets here second prints that verdict."""
        if not self._firing.acquire(blocking=False):
            if exit:  # another thread is reporting and will end the process
                threading.Event().wait()
            return None
        me, op = dumps.global_rank(), f"{entry.op} #{entry.seq}"
        states: dict[int, dict | None] = {me: self.state(desync.IN_OP)}
        reporter, published, notes = me, None, []
        text = verdict = None
        try:
            if channel.available():
                with channel.store() as store:
                    channel.put_json(store, rounds.state_key(me), states[me])
                    request = rounds.claim(store, {"rank": me, "time_ns": time.time_ns(), "op": op},
                                           born_ns=self._born_ns)
                    reporter = request["rank"]
                    if reporter == me:
                        states.update(rounds.collect(store, me, dumps.world_size(), self.report_wait_s))
                        text, verdict = self._report(entry, reason, states, notes)
                        rounds.publish(store, rank=me, op=op, text=text, verdict=asdict(verdict), states=states)
                    else:
                        published = rounds.await_report(store, self.follow_wait_s)
                        if published is None:
                            notes.append(f"(rank {reporter} timed out first, in {request['op']}, but published "
                                         f"no report within {self.follow_wait_s:.1f} s: this is rank {me}'s own)")
                            states.update(rounds.collect(store, me, dumps.world_size(), 0.0))
        except Exception as e:  # noqa: BLE001 - report what we have
            notes.append(f"(side channel failed: {type(e).__name__}: {e}; other ranks' states are missing)")
        if published is not None:
            states = {**published["states"], me: states[me]}
            text = (f"plait.debug: rank {me}: {reason}; rank {reporter} timed out first, in "
                    f"{published['op']}, and reported for the job:\n{published['text']}")
            verdict_doc = published["verdict"]
        else:
            if text is None or notes:  # no store, or it failed after the verdict: say so in the text
                text, verdict = self._report(entry, reason, states, notes)
            verdict_doc = asdict(verdict)
        sys.stderr.write(text + "\n")
        path = self._dump(f"watchdog: {reason}", {
            "report": text, "verdict": verdict_doc, "reported_by": reporter,
            "peers": {str(r): s for r, s in states.items() if r != me and s is not None},
        })
        if path:
            sys.stderr.write(f"plait.debug: rank {me}: flight recorder dumped to {path}\n")
        self._leave(rounds.still_reading(states, me))
        if exit:
            self._exit()
        return text

    def _report(self, entry: Entry, reason: str, states: dict[int, dict | None],
                notes: list[str]) -> tuple[str, desync.Verdict]:
        return desync.report(entry.to_dict(), states, me=dumps.global_rank(), reason=reason,
                             timeout_s=self.timeout_for(entry.group),
                             hints=self._hints(entry.group, entry.group_ranks) + notes, dump_dir=self._trace_dir)

    def _leave(self, peers: list[int]) -> None:
        """Done with the store; stay (bounded) until the peers still reading it are too: this
        process may be the store's host."""
        try:
            if channel.available():
                with channel.store() as store:
                    late = rounds.leave(store, dumps.global_rank(), peers, self.leave_wait_s)
                if late:
                    sys.stderr.write(f"plait.debug: rank {dumps.global_rank()}: rank(s) {late} did not finish "
                                     f"reading the report within {self.leave_wait_s:.1f} s; stopping anyway\n")
        except Exception:  # noqa: BLE001 - the job is ending; a peer's read may fail, ours is done
            pass

    def _respond(self, request: dict) -> None:
        if not self._firing.acquire(blocking=False):
            return  # this rank is reporting itself
        me = dumps.global_rank()
        peers = [request["rank"]]
        try:
            with channel.store() as store:
                channel.put_json(store, rounds.state_key(me), self.state(desync.RUNNING))
            path = self._dump(f"desync report requested by rank {request['rank']} ({request['op']} timed out)", {})
            sys.stderr.write(f"plait.debug: rank {me}: rank {request['rank']} timed out in {request['op']}; "
                             f"flight recorder dumped to {path}; stopping this rank\n")
            with channel.store() as store:
                published = rounds.await_report(store, self.follow_wait_s)
            if published is not None:
                peers = rounds.still_reading(published["states"], me)
        except Exception as e:  # noqa: BLE001 - stop anyway
            sys.stderr.write(f"plait.debug: rank {me}: answering rank {request['rank']} failed: {e}\n")
        self._leave(peers)
        self._exit()

    def linger(self) -> None:
        """At this process's exit, after stop(): if it serves the job's store, stay until every
        peer has ended or reported (bounded by the longest a peer's op can still take to time
        out, plus a report), so a peer still in an op reports with the store, not without it."""
        try:
            if not (channel.available() and channel.hosts_store()):
                return
            me = dumps.global_rank()
            timeouts = [self.timeout_for(g) for g in self._last_entered] or [self.timeout_for("")]
            bound = max(timeouts) + self.poll_s + self.round_s
            deadline, said = time.monotonic() + bound, False
            with channel.store() as store:
                while (left := rounds.unfinished(store, me, dumps.world_size())) and time.monotonic() < deadline:
                    if not said and time.monotonic() > deadline - bound + 1.0:
                        said = True
                        sys.stderr.write(f"plait.debug: rank {me} serves the job's store: waiting up to "
                                         f"{bound:.0f} s for rank(s) {left} to end or report a hang\n")
                    time.sleep(self.poll_s)
        except Exception:  # noqa: BLE001 - the store is ours and going away: nothing more to do
            pass

    @staticmethod
    def _exit() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep us alive
                pass
        os._exit(WATCHDOG_EXIT_CODE)
