"""The debugging session: one listener at plait.comm's door that runs, in a fixed order,
everything the config asks for; `configure()` swaps it for another.

    on_start(event): call site (+ stack) -> Entry (into the ring if the recorder is on)
        -> watchdog.enter -> [DETAIL] consistency check: a mismatch dumps and raises on
           every rank before anything is sent -> entry "started"
    on_end(event):   entry "completed" -> watchdog.leave -> [DETAIL] log line -> [INFO] tally
    the default (recorder only): on_start records the entry "started"; no on_end, the
        entry reads the end time the door writes into its event
    unhandled exception: dump (+ desync report if a collective failed under the watchdog)
    SIGUSR1: dump          exit: [INFO] summary; [watchdog] last state left for peers, and
                          the store's host stays until its peers have ended or reported

Module state is the one active session and its config; a forked child keeps the config
but drops what does not survive a fork (threads, store connections, signal routing).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import torch.distributed as dist

from plait.comm import events, shutdown
from plait.debug import channel, trace, triggers, wrap
from plait.debug import dump as dumps
from plait.debug.callsite import stack, user_frame
from plait.debug.check import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConsistencyCheck,
    remaining,
)
from plait.debug.config import DebugConfig
from plait.debug.desync import EXITED, FAILED
from plait.debug.recorder import ENTRY_IDS, Entry, FlightRecorder, new_entry
from plait.debug.watchdog import Watchdog, group_timeout_s

_KEY = "plait.debug"  # where a session keeps its Entry in event.extra


class Session(events.CommListener):
    def __init__(self, config: DebugConfig, recorder: FlightRecorder | None) -> None:
        self.config = config
        self.recorder = recorder
        self.check = ConsistencyCheck() if config.wants_check else None
        self.summary = trace.Summary() if config.wants_summary else None
        self.watchdog = Watchdog(timeout_s=config.timeout_s, dump=self.dump, hints=self._hints,
                                 trace_dir=config.trace_dir) if config.wants_watchdog else None
        self.findings: dict = {}  # what a check or the watchdog found: kept in every later dump
        self.signal_pending = recorder is not None
        # the recorder alone needs nothing at completion: the door is told not to call on_end
        self.wants_end = not (recorder is not None and self.check is None and self.summary is None
                              and self.watchdog is None and not config.wants_log)

    # -- the door -----------------------------------------------------------------------------
    def on_start(self, event: events.CommEvent) -> None:
        if self.signal_pending:
            self._route_signal()
        frame = user_frame(sys._getframe(1))  # call_site(1), inline: once per op
        site = None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        trail = stack(1) if self.config.stacks else None
        if not self.wants_end:  # the recorder alone: no check, so the op starts as it is issued;
            rec = self.recorder  # FlightRecorder.record inline: a tuple, no frame (an Entry when read)
            rec.append((next(ENTRY_IDS), event, site, trail, event.start_ns))
            rec.total += 1
            return
        entry = self.recorder.record(event, site, trail) if self.recorder else new_entry(event, site, trail)
        event.extra[_KEY] = entry
        if self.watchdog is not None:
            self.watchdog.enter(event, entry)
        if self.check is not None:
            try:
                self.check.before(event, site, self._check_wait_s(event))
            except (CollectiveMismatchError, CollectiveTimeoutError) as e:
                self._stopped(entry, e)
                raise
            except Exception as e:  # the side channel failed (a dead store): the op is not sent
                entry.error = f"consistency check failed: {type(e).__name__}: {e}"
                if self.watchdog is not None:
                    self.watchdog.leave(entry, completed=False)
                raise RuntimeError(f"plait.debug could not check {event.op} #{event.seq} on group "
                                   f"{event.group_name} against the other ranks: {e}") from e
        entry.started()

    def on_end(self, event: events.CommEvent) -> None:
        entry = event.extra.get(_KEY)
        if entry is None:
            return  # issued before this session was installed
        entry.completed(event.end_ns)
        if self.watchdog is not None:
            self.watchdog.leave(entry)
        if self.config.wants_log:
            trace.log_entry(entry)
        if self.summary is not None:
            self.summary.add(entry)

    def on_failed(self, event: events.CommEvent, error: BaseException) -> None:
        """A wrapped torch.distributed call raised: the op is over, but did not complete."""
        entry = event.extra.get(_KEY)
        if entry is not None:
            entry.error = f"{type(error).__name__}: {error}"
            if self.watchdog is not None:
                self.watchdog.leave(entry, completed=False)

    def _stopped(self, entry: Entry, error: Exception) -> None:
        entry.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        if self.watchdog is not None:
            self.watchdog.leave(entry, completed=False)
        if isinstance(error, CollectiveMismatchError):
            self.findings = {"report": str(error), "mismatch": {
                "group": error.group, "seq": error.seq, "kind": error.kind, "culprits": error.culprits,
                "calls": {str(r): c for r, c in error.calls.items()}}}
        else:
            self.findings = {"report": str(error)}
        path = self.dump(f"{type(error).__name__}: {str(error).splitlines()[0]}", {})
        trace.logger.error("%s\nflight recorder dumped to %s", error, path)

    def _check_wait_s(self, event: events.CommEvent) -> float:
        """How long the check waits for the other ranks: the op's timeout, plus enough for
        the watchdog, which reports with every rank's state, to act first."""
        wd = self.watchdog
        if wd is None:  # a forked child: no watchdog thread
            return remaining(event, self.config.timeout_s or group_timeout_s(event.group_name))
        return remaining(event, wd.timeout_for(event.group_name)) + 2 * wd.poll_s + wd.round_s + 1.0

    def _hints(self, group: str, ranks: tuple[int, ...]) -> list[str]:
        return self.check.divergence_hint(group, ranks) if self.check is not None else []

    def _route_signal(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.signal_pending = False
            triggers.install_signal(_on_signal)

    # -- dumps ----------------------------------------------------------------------------------
    def dump(self, reason: str, extra: dict, path: str | None = None) -> str | None:
        rec = self.recorder
        entries = rec.snapshot() if rec is not None else []
        doc = dumps.build(entries, reason=reason, buffer_size=rec.capacity if rec else 0,
                          dropped=rec.dropped if rec else 0, extra={**self.findings, **extra})
        if self.summary is not None:
            doc["summary"] = self.summary.totals()
        try:
            return dumps.write(doc, self.config.trace_dir, path)
        except OSError as e:
            sys.stderr.write(f"plait.debug: could not write the flight recorder dump: {e}\n")
            return None


_lock = threading.RLock()
_config = DebugConfig(buffer_size=0)  # until activated: nothing
_session: Session | None = None
_recorder: FlightRecorder | None = None
_exit_error: BaseException | None = None
_hooks_registered = False
_exited = False  # _at_exit ran (it is reached from two hooks)


def apply(config: DebugConfig) -> None:
    """Make `config` the active one: swap the listener, wrappers and watchdog to match."""
    global _config, _session, _recorder
    with _lock:
        old = _session
        if old is not None and old.watchdog is not None:
            old.watchdog.stop()
        if not config.wants_recorder:
            _recorder = None
        elif _recorder is None or _recorder.capacity != config.buffer_size:
            _recorder = FlightRecorder(config.buffer_size)
        session = Session(config, _recorder) if config.wants_listener else None
        if session is not None:
            if old is not None:
                session.signal_pending = old.signal_pending and session.signal_pending
            if session.watchdog is not None:
                session.watchdog.start()
        events.set_debug_listener(session)
        if config.wants_wrap:
            wrap.install()
        else:
            wrap.uninstall()
        if config.wants_log:
            trace.ensure_handler()
        if session is not None:
            triggers.install_excepthooks(_on_exception)
        else:
            triggers.uninstall_excepthooks()
        _config, _session = config, session
        _register_process_hooks()


def current_config() -> DebugConfig:
    return _config


def summary() -> dict[str, dict[str, dict]]:
    """INFO/DETAIL: this rank's totals so far, group -> op -> {count, bytes, seconds}."""
    s = _session
    return s.summary.totals() if s is not None and s.summary is not None else {}


def session() -> Session | None:
    return _session


def activate_from_env() -> None:
    """What `import plait.comm` runs: the flight recorder by default, and whatever the
    PLAIT_* environment asks for. Once per process."""
    global _activated
    if not _activated:
        _activated = True
        apply(DebugConfig.from_env())


_activated = False


def configure(**settings: object) -> DebugConfig:
    """Change debug settings in this process (level, desync, timeout, buffer_size, stacks,
    trace_dir); returns the previous config, for `apply()` to restore."""
    previous = _config
    apply(previous.replace(**settings))
    return previous


@contextlib.contextmanager
def configured(**settings: object) -> Iterator[DebugConfig]:
    """Debug settings for the duration of a block."""
    previous = configure(**settings)
    try:
        yield _config
    finally:
        apply(previous)


def dump_flight_recorder(path: str | None = None, *, reason: str = "requested") -> str | None:
    """Write this rank's flight recorder now; returns the file's path."""
    s = _session or Session(_config, _recorder)
    return s.dump(reason, {}, path)


# -- process-wide triggers --------------------------------------------------------------------
def _on_signal(signum: int) -> None:
    s = _session
    if s is not None:
        path = s.dump(f"signal {signum} (SIGUSR1)", {})
        sys.stderr.write(f"plait.debug: flight recorder dumped to {path}\n")


def _looks_like_comm_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection closed"))


def _on_exception(error: BaseException) -> None:
    global _exit_error
    _exit_error = error
    s = _session
    if s is None or (s.recorder is None and s.watchdog is None):
        return
    if s.watchdog is not None:
        s.watchdog.wait_if_reporting()  # a peer's exit made our op fail: the report ends the process
    reason = f"unhandled {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    stuck = s.watchdog is not None and s.watchdog.oldest_in_flight()
    if stuck and _looks_like_comm_failure(error):
        s.watchdog.fire(stuck, reason, exit=False)  # reports and dumps
        return
    if s.recorder is not None and s.recorder.total:
        path = s.dump(reason, {})
        sys.stderr.write(f"plait.debug: flight recorder dumped to {path}\n")
    if s.watchdog is not None:
        s.watchdog.publish(FAILED, reason)


def _at_exit() -> None:
    """Once per process: from plait.comm's exit hook while the groups still exist (it runs
    first: registered later), or from atexit where no Gloo group armed that hook."""
    global _exited
    s = _session
    if s is None or _exited:
        return
    _exited = True
    rank = dumps.global_rank()
    if s.summary is not None and s.summary.totals():
        sys.stderr.write("[plait.debug] " + s.summary.text(rank).replace("\n", "\n[plait.debug] ") + "\n")
    if s.watchdog is not None:
        if _exit_error is None:
            s.watchdog.publish(EXITED)
        s.watchdog.stop()  # before lingering: this rank answers no request once it has ended
        s.watchdog.linger()


def _after_fork_in_child() -> None:
    global _session
    triggers.uninstall_signal(in_forked_child=True)
    channel.forget()
    if _recorder is not None:
        _recorder.clear()
    if _session is not None:
        _session.signal_pending = _session.recorder is not None
        _session.watchdog = None  # its thread did not survive the fork


def _register_process_hooks() -> None:
    global _hooks_registered
    if not _hooks_registered:
        _hooks_registered = True
        atexit.register(_at_exit)
        shutdown.before_exit(_at_exit)
        os.register_at_fork(after_in_child=_after_fork_in_child)
