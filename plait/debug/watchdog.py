"""The watchdog: an op that outlives its timeout ends the job, with a report that names who.

    enter(op) -> in flight, deadline = issued + timeout -> leave(op) at completion
    thread, every poll_s: an op whose Work is done -> completed (even if nobody waited yet)
                          an op past its deadline  -> fire()
                          a peer asked for states  -> respond()
    fire():    publish my state, ask every rank for theirs (store key desync/request), wait
               for them (bounded), print the desync report, dump the flight recorder, exit 124
    respond(): publish my state and stacks, dump my flight recorder, wait until the reporter
               has read the states (bounded), exit 124 — the whole job stops, each rank
               leaving its dump, so the launcher can restart it

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
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from plait.comm.events import CommEvent
from plait.debug import channel, desync
from plait.debug import dump as dumps
from plait.debug.callsite import thread_stacks
from plait.debug.config import WATCHDOG_EXIT_CODE
from plait.debug.recorder import Entry

REPORT_WAIT_MAX_S = 5.0


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
        self.report_wait_s = min(REPORT_WAIT_MAX_S, 1.0 + 2 * self.poll_s)
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
            self._stop.wait(self.report_wait_s + 10.0)

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
            if not store.check(["desync/request"]):
                return
            request = channel.get_json(store, ["desync/request"])[0]
        if request["rank"] != dumps.global_rank() and request["time_ns"] >= self._born_ns:
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
        """Report `entry` as stuck: gather every rank's state, print, dump; then exit."""
        if not self._firing.acquire(blocking=False):
            if exit:  # another thread is reporting and will end the process
                threading.Event().wait()
            return None
        me = dumps.global_rank()
        states: dict[int, dict | None] = {me: self.state(desync.IN_OP)}
        note = None
        try:
            if channel.available():
                with channel.store() as store:
                    channel.put_json(store, f"state/{me}", states[me])
                    channel.put_json(store, "desync/request",
                                     {"rank": me, "time_ns": time.time_ns(), "op": f"{entry.op} #{entry.seq}"})
                    states.update(self._collect(store, me))
        except Exception as e:  # noqa: BLE001 - report what we have
            note = f"(side channel failed: {type(e).__name__}: {e}; other ranks' states are missing)"
        hints = self._hints(entry.group, entry.group_ranks) + ([note] if note else [])
        text, verdict = desync.report(entry.to_dict(), states, me=me, reason=reason,
                                      timeout_s=self.timeout_for(entry.group), hints=hints,
                                      dump_dir=self._trace_dir)
        sys.stderr.write(text + "\n")
        path = self._dump(f"watchdog: {reason}", {
            "report": text, "verdict": asdict(verdict),
            "peers": {str(r): s for r, s in states.items() if r != me and s is not None},
        })
        if path:
            sys.stderr.write(f"plait.debug: rank {me}: flight recorder dumped to {path}\n")
        try:
            if channel.available():
                with channel.store() as store:
                    store.set(f"desync/done/{me}", "1")
        except Exception:  # noqa: BLE001 - peers wait for this key with a bound anyway
            pass
        if exit:
            self._exit()
        return text

    def _collect(self, store: dist.Store, me: int) -> dict[int, dict | None]:
        others = [r for r in range(dumps.world_size()) if r != me]
        keys = [f"state/{r}" for r in others]
        channel.wait(store, keys, self.report_wait_s)
        present = channel.present(store, keys)
        found = [k for k, p in zip(keys, present) if p]
        states: dict[int, dict | None] = {r: None for r in others}
        for key, state in zip(found, channel.get_json(store, found)):
            states[int(key.rsplit("/", 1)[1])] = state
        return states

    def _respond(self, request: dict) -> None:
        if not self._firing.acquire(blocking=False):
            return  # this rank is reporting itself
        me = dumps.global_rank()
        try:
            with channel.store() as store:
                channel.put_json(store, f"state/{me}", self.state(desync.RUNNING))
            path = self._dump(f"desync report requested by rank {request['rank']} ({request['op']} timed out)", {})
            sys.stderr.write(f"plait.debug: rank {me}: rank {request['rank']} timed out in {request['op']}; "
                             f"flight recorder dumped to {path}; stopping this rank\n")
            with channel.store() as store:
                channel.wait(store, [f"desync/done/{request['rank']}"], self.report_wait_s + 2.0)
        except Exception as e:  # noqa: BLE001 - stop anyway
            sys.stderr.write(f"plait.debug: rank {me}: answering rank {request['rank']} failed: {e}\n")
        self._exit()

    @staticmethod
    def _exit() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep us alive
                pass
        os._exit(WATCHDOG_EXIT_CODE)
