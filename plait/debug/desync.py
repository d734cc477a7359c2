"""The desync report: from every rank's state, who is stuck where and who never came.

    stuck entry + {global rank: state | None} -> Verdict(entered, missing, culprits)
                                              -> a few lines of text for a person

A rank's state (see Watchdog.state) says how many ops it has issued per group
(`groups[g].seq`, and per p2p stream `groups[g].p2p["send->1"]`), its last entered and
completed op per group, what it has in flight, whether it is running, stuck, exited or
failed, and its threads' stacks. A member "entered" collective #k of group g when its
counter for g has reached k; it "entered" send #k from a to b when b has posted k recvs
from a. Pure functions: the watchdog and the tests call them alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from plait.debug.callsite import format_site
from plait.debug.fingerprint import describe, missing_culprits

RUNNING, IN_OP, EXITED, FAILED = "running", "in op", "exited", "failed"


@dataclass
class Verdict:
    entered: list[int]  # global ranks that issued the stuck op
    missing: list[int]  # global ranks that never issued it (or its p2p counterpart)
    unknown: list[int]  # global ranks that did not answer
    culprits: list[int]
    why: str


def p2p_key(kind: str, peer: int) -> str:
    return f"send->{peer}" if kind == "send" else f"recv<-{peer}"


def verdict(stuck: dict, states: dict[int, dict | None], _nested: bool = False) -> Verdict:
    """Who entered the op `stuck` (an entry dict) and who never did."""
    group, ranks, seq = stuck["group"], stuck["group_ranks"], stuck["seq"]
    if stuck["p2p"]:
        me, peer = stuck["rank"], stuck["peer"]
        other = "recv" if stuck["op"] == "send" else "send"
        members = {ranks[me]: (stuck["op"], peer), ranks[peer]: (other, me)}
    else:
        members = {g: None for g in ranks}
    entered, missing, unknown, status = [], [], [], {}
    for g, counter in members.items():
        state = states.get(g)
        if state is None:
            unknown.append(g)
            continue
        status[g] = state["status"]
        info = state["groups"].get(group, {})
        count = info.get("seq", 0) if counter is None else info.get("p2p", {}).get(p2p_key(*counter), 0)
        (entered if count >= seq else missing).append(g)
    g_me = stuck.get("global_rank")
    if g_me in unknown:  # the reporting rank is in the op, whatever its state says
        unknown.remove(g_me)
        entered.append(g_me)
    if stuck["p2p"]:  # a peer busy in another op has moved on without the matching one
        status = {r: RUNNING if s == IN_OP else s for r, s in status.items()}
    culprits = missing_culprits(entered, missing, status) if missing else []
    if not culprits and missing and not _nested:
        for r in missing:  # a missing rank may itself be blocked: follow it one step
            blocked = (states.get(r) or {}).get("in_flight") or []
            if blocked:
                inner = verdict(blocked[0], states, _nested=True)
                if inner.culprits and r not in inner.culprits:
                    why = (f"rank {r} is blocked in {_op(blocked[0])}, which rank(s) {inner.missing} "
                           f"never matched")
                    return Verdict(sorted(entered), sorted(missing), sorted(unknown), inner.culprits, why)
    if not missing:
        why = "every rank entered it; none is missing (a transport problem, or a rank stuck inside the op)"
    elif culprits == sorted(missing):
        why = "never entered it"
    elif culprits == sorted(entered) and all(status.get(r) == EXITED for r in missing):
        why = "issued an op the others never issued: they finished without it"
    elif culprits == sorted(entered):
        why = "the only rank(s) in this op: the others are elsewhere"
    else:
        why = "undecided: the ranks split evenly, compare where each one is"
    return Verdict(sorted(entered), sorted(missing), sorted(unknown), culprits, why)


def _op(entry: dict | None) -> str:
    if not entry:
        return "nothing"
    head = f"{entry['op']} #{entry['seq']}"
    if entry.get("p2p"):
        head += f" {'to' if entry['op'] == 'send' else 'from'} rank {entry.get('peer_global')}"
    return f"{head} on group {entry['group']} at {format_site(entry.get('site'))} ({entry['state']})"


def rank_line(rank: int, state: dict | None, now_ns: int) -> str:
    if state is None:
        return f"rank {rank}: no answer (crashed, killed, or the store is unreachable)"
    status = state["status"]
    if state.get("in_flight"):
        e = state["in_flight"][0]
        since = (now_ns - e["time_scheduled_ns"]) / 1e9
        head = f"rank {rank}: in {_op(e)}, for {since:.1f} s"
    elif status == RUNNING:
        where = (state.get("threads", {}).get("MainThread") or {}).get("where")
        head = f"rank {rank}: running, in no op" + (f"; now at {where}" if where else "")
    else:
        head = f"rank {rank}: {status}" + (f" ({state['error']})" if state.get("error") else "")
    lasts = [(g["last_entered"], g["last_completed"]) for g in state["groups"].values() if g.get("last_entered")]
    if lasts:
        entered, completed = max(lasts, key=lambda p: p[0]["time_scheduled_ns"])
        if not any(e["id"] == entered["id"] for e in state.get("in_flight", [])):
            head += f"; last entered {_op(entered)}"
        if completed and completed["id"] != entered["id"]:
            head += f"; last completed {_op(completed)}"
    return head


def report(stuck: dict, states: dict[int, dict | None], *, me: int, reason: str, timeout_s: float,
           hints: list[str] = (), dump_dir: str | None = None) -> tuple[str, Verdict]:
    """The text a person reads first when a job hangs."""
    now = time.time_ns()
    v = verdict(stuck, states)
    waited = (now - stuck["time_scheduled_ns"]) / 1e9
    lines = [
        f"plait.debug desync report from rank {me}: {reason}",
        f"stuck op: {describe(stuck)} — {_op(stuck)}, entered {waited:.1f} s ago "
        f"(timeout {timeout_s:.1f} s), group ranks {list(stuck['group_ranks'])}",
        f"entered it: {v.entered}   never entered it: {v.missing}"
        + (f"   no answer: {v.unknown}" if v.unknown else ""),
        f"culprit(s): {v.culprits if v.culprits else 'undecided'} — {v.why}",
        "rank by rank:",
    ]
    lines += ["  " + rank_line(r, states.get(r), now) for r in sorted(states)]
    lines += list(hints)
    for r in v.culprits or v.missing:
        state = states.get(r)
        threads = (state or {}).get("threads") or {}
        main = threads.get("MainThread")
        if main and main.get("stack"):
            lines.append(f"--- rank {r} main thread stack ---")
            lines.append(main["stack"].rstrip())
    if dump_dir:
        lines.append(f"flight recorder dumps: {dump_dir} — run `plait debug analyze {dump_dir}`")
    return "\n".join(lines), v

