"""Read every rank's flight-recorder dump; find the first op on which the ranks disagree.

    DIR/rank*.json -> load (the newest job's dumps) -> one RankView per rank
        (from its own dump, or from the state a peer's desync report carries for it)
    -> collectives, per group: op #k from the oldest one still recorded — who entered it
       (its counter reached k), do the fingerprints agree, did the states agree
    -> p2p, per group and direction a->b: send #k of a against recv #k of b
    -> problems ordered by when their op was first entered; the first one is the answer

Kinds are torch's analyzer's (missing rank, op type, size, dtype, state mismatch); blame
follows `fingerprint.minority` / `missing_culprits`, the same rules the live check and the
watchdog use. Pure: `analyze(dir)` returns an Analysis; `plait debug analyze` prints it.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass, field

from plait.debug import fingerprint as fp
from plait.debug.callsite import format_site
from plait.debug.config import DUMP_FORMAT


@dataclass
class RankView:
    rank: int
    source: str  # "dump", or "report of rank R" for a rank that left no dump of its own
    status: str  # running | in op | exited | failed
    reason: str
    groups: dict  # name -> {"ranks", "seq", "p2p"}
    entries: list[dict]
    where: str | None  # the main thread's user line when the dump was taken

    def collective(self, group: str) -> dict[int, dict]:
        return {e["seq"]: e for e in self.entries if e["group"] == group and not e["p2p"]}

    def p2p(self, group: str, kind: str, peer: int) -> dict[int, dict]:
        return {e["seq"]: e for e in self.entries
                if e["group"] == group and e["op"] == kind and e["peer"] == peer}


@dataclass
class Problem:
    kind: str
    group: str
    group_ranks: list[int]
    seq: int
    op: str
    culprits: list[int]
    why: str
    sides: list[dict]  # {"ranks", "call", "site", "state"}
    time_ns: int
    p2p: dict | None = None  # {"src", "dst"} (global ranks) for a send/recv stream
    consequence_of: str | None = None  # another problem that keeps the missing ranks away

    def key(self) -> tuple:
        return (self.group, self.op, self.seq, None if self.p2p is None else (self.p2p["src"], self.p2p["dst"]))


@dataclass
class Analysis:
    directory: str
    job_id: str | None
    world_size: int
    ranks: dict[int, dict]  # rank -> {"source", "status", "reason"}
    missing_dumps: list[int]
    problems: list[Problem] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def first(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    def to_json(self) -> dict:
        out = asdict(self)
        out["first"] = asdict(self.first) if self.first else None
        return out


def load(directory: str) -> tuple[list[dict], list[str]]:
    """The newest job's dumps in `directory`, and warnings about the files left out."""
    docs, warnings = [], []
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            warnings.append(f"{path}: unreadable ({e})")
            continue
        if doc.get("format") != DUMP_FORMAT:
            warnings.append(f"{path}: not a plait flight-recorder dump")
            continue
        docs.append(doc)
    if not docs:
        return [], warnings
    newest = max(docs, key=lambda d: d["dump_time_ns"])
    same = [d for d in docs if d.get("job_id") == newest.get("job_id")]
    if len(same) < len(docs):
        warnings.append(f"ignored {len(docs) - len(same)} dump(s) of another job than {newest.get('job_id')!r}")
    return same, warnings


def _view(doc: dict) -> RankView:
    status = doc.get("status", "running")
    if str(doc.get("reason", "")).startswith("unhandled"):
        status = "failed"
    main = (doc.get("threads") or {}).get("MainThread") or {}
    return RankView(doc["rank"], "dump", status, doc.get("reason", ""), doc.get("groups", {}),
                    doc.get("entries", []), main.get("where"))


def _view_from_state(state: dict, reporter: int) -> RankView:
    entries: dict[int, dict] = {}
    for info in state.get("groups", {}).values():
        for e in (info.get("last_entered"), info.get("last_completed")):
            if e:
                entries[e["id"]] = e
    for e in state.get("in_flight", []):
        entries[e["id"]] = e
    main = (state.get("threads") or {}).get("MainThread") or {}
    return RankView(state["rank"], f"report of rank {reporter}", state.get("status", "running"),
                    state.get("error") or "", state.get("groups", {}), list(entries.values()), main.get("where"))


def _side(view: RankView | None, ranks: list[int], entry: dict | None) -> dict:
    return {"ranks": ranks, "call": fp.describe(entry) if entry else None,
            "site": format_site(entry.get("site")) if entry else None,
            "state": entry.get("state") if entry else None}


def _missing_side(view: RankView, group: str) -> dict:
    last = max((e for e in view.entries if e["group"] == group), key=lambda e: e["seq"], default=None)
    where = f"; now at {view.where}" if view.where and view.status in ("running", "in op") else ""
    text = f"{view.status}" + (f"; last op on this group: {last['op']} #{last['seq']} at "
                               f"{format_site(last.get('site'))} ({last['state']})" if last else "") + where
    return {"ranks": [view.rank], "call": None, "site": None, "state": text}


def _collectives(views: dict[int, RankView], group: str, ranks: list[int], hints: list[str]) -> Problem | None:
    members = [r for r in ranks if r in views]
    tables = {r: views[r].collective(group) for r in members}
    counts = {r: views[r].groups.get(group, {}).get("seq", max(tables[r], default=0)) for r in members}
    recorded = [min(t) for t in tables.values() if t]
    if not recorded:
        return None
    status = {r: views[r].status for r in members}
    hinted = False
    for k in range(min(recorded), max(counts.values()) + 1):
        entered = [r for r in members if counts[r] >= k]
        missing = [r for r in members if counts[r] < k]
        present = {r: tables[r][k] for r in entered if k in tables[r]}
        if not present:
            continue
        time_ns = min(e["time_scheduled_ns"] for e in present.values())
        any_entry = next(iter(present.values()))
        if missing:
            culprits = fp.missing_culprits(entered, missing, status)
            why = ("never entered it" if culprits == sorted(missing) else
                   "issued an op the others never issued" if culprits else "undecided: the ranks split evenly")
            sides = [_side(views[r], [r], present.get(r)) for r in entered]
            sides += [_missing_side(views[r], group) for r in missing]
            return Problem(fp.MISSING_RANK, group, ranks, k, any_entry["op"], culprits, why, sides, time_ns)
        verdict = fp.classify({r: fp.fingerprint(e) for r, e in present.items()})
        if verdict is not None:
            sides = []
            for _, side_ranks in verdict.sides:
                sides.append(_side(views[side_ranks[0]], side_ranks, present[side_ranks[0]]))
            why = "the odd one(s) out" if verdict.culprits else "undecided: the ranks split evenly"
            return Problem(verdict.kind, group, ranks, k, any_entry["op"], verdict.culprits, why, sides, time_ns)
        states = {r: ("completed" if e["state"] == "completed" else "not completed") for r, e in present.items()}
        if len(set(states.values())) > 1:
            groups = [("not completed", [r for r, s in states.items() if s == "not completed"]),
                      ("completed", [r for r, s in states.items() if s == "completed"])]
            culprits = fp.minority(groups) or groups[0][1]
            sides = [_side(views[rs[0]], rs, present[rs[0]]) for _, rs in groups]
            return Problem(fp.STATE, group, ranks, k, any_entry["op"], sorted(culprits),
                           "did not complete an op the others completed", sides, time_ns)
        if len(present) == len(members) and all(e["state"] != "completed" and not e.get("error")
                                                 for e in present.values()) and k == max(counts.values()):
            return Problem(fp.NOT_COMPLETED, group, ranks, k, any_entry["op"], [],
                           "every rank is inside the op: a transport problem, or a rank stuck inside it",
                           [_side(views[members[0]], members, present[members[0]])], time_ns)
        sites = {r: format_site(e.get("site")) for r, e in present.items()}
        if not hinted and len(set(sites.values())) > 1:
            hinted = True
            hints.append(f"group {group}: call sites first differ at op #{k} (the ops matched): "
                         + "; ".join(f"rank {r} at {s}" for r, s in sorted(sites.items())))
    return None


def _p2p(views: dict[int, RankView], group: str, ranks: list[int]) -> list[Problem]:
    problems = []
    for a_g in range(len(ranks)):
        for b_g in range(len(ranks)):
            a, b = ranks[a_g], ranks[b_g]
            if a == b or a not in views or b not in views:
                continue
            sends, recvs = views[a].p2p(group, "send", b_g), views[b].p2p(group, "recv", a_g)
            n_send = views[a].groups.get(group, {}).get("p2p", {}).get(f"send->{b_g}", max(sends, default=0))
            n_recv = views[b].groups.get(group, {}).get("p2p", {}).get(f"recv<-{a_g}", max(recvs, default=0))
            # a peer busy in another op has moved on without the matching one
            status = {r: "running" if views[r].status == "in op" else views[r].status for r in (a, b)}
            for k in sorted(set(sends) | set(recvs)):
                s, r = sends.get(k), recvs.get(k)
                if s is not None and r is not None:
                    verdict = fp.classify({a: fp.fingerprint(s), b: fp.fingerprint(r)})
                    if verdict is not None:
                        problems.append(Problem(
                            verdict.kind, group, ranks, k, "send/recv", [], "sender and receiver disagree",
                            [_side(views[a], [a], s), _side(views[b], [b], r)],
                            min(s["time_scheduled_ns"], r["time_scheduled_ns"]), {"src": a, "dst": b}))
                        break
                    continue
                if s is not None and k > n_recv and s["state"] != "completed":
                    lone, lone_rank, other, what = s, a, b, "recv"
                elif r is not None and k > n_send and r["state"] != "completed":
                    lone, lone_rank, other, what = r, b, a, "send"
                else:
                    continue  # the other side's record was evicted, or matched after its dump
                culprits = fp.missing_culprits([lone_rank], [other], status)
                problems.append(Problem(
                    fp.MISSING_RANK, group, ranks, k, lone["op"], culprits,
                    f"rank {other} never posted the matching {what} #{k}",
                    [_side(views[lone_rank], [lone_rank], lone), _missing_side(views[other], group)],
                    lone["time_scheduled_ns"], {"src": a, "dst": b}))
                break
    return problems


def analyze(directory: str) -> Analysis:
    docs, warnings = load(directory)
    if not docs:
        raise FileNotFoundError(f"no plait flight-recorder dumps (rank*.json) in {directory}")
    views = {d["rank"]: _view(d) for d in docs}
    for d in docs:  # ranks that left no dump may be described by a peer's desync report
        for rank, state in (d.get("peers") or {}).items():
            if int(rank) not in views and state:
                views[int(rank)] = _view_from_state(state, d["rank"])
    world = max(max(d.get("world_size", 1) for d in docs), max(views) + 1)
    result = Analysis(directory, docs[0].get("job_id"), world,
                      {r: {"source": v.source, "status": v.status, "reason": v.reason} for r, v in sorted(views.items())},
                      sorted(set(range(world)) - set(views)), warnings=warnings)
    groups: dict[str, list[int]] = {}
    for v in views.values():
        for name, info in v.groups.items():
            groups.setdefault(name, list(info["ranks"]))
        for e in v.entries:
            groups.setdefault(e["group"], list(e["group_ranks"]))
    for name, ranks in sorted(groups.items()):
        problem = _collectives(views, name, ranks, result.hints)
        if problem is not None:
            result.problems.append(problem)
        result.problems += _p2p(views, name, ranks)
    _mark_consequences(result.problems, views)
    result.problems.sort(key=lambda p: (p.consequence_of is not None, p.time_ns))
    return result


def _blocked_in(view: RankView) -> tuple | None:
    """The key of the op `view`'s rank is stuck in (its newest op not completed), if any."""
    pending = [e for e in view.entries if e["state"] != "completed" and not e.get("error")]
    if not pending:
        return None
    e = max(pending, key=lambda e: e["time_scheduled_ns"])
    src_dst = None
    if e["p2p"]:
        me, peer = e["group_ranks"][e["rank"]], e["peer_global"]
        src_dst = (me, peer) if e["op"] == "send" else (peer, me)
    return (e["group"], e["op"], e["seq"], src_dst)


def _mark_consequences(problems: list[Problem], views: dict[int, RankView]) -> None:
    """A rank missing from one op because it is blocked in another problem's op is a
    consequence of that problem, which is reported first."""
    by_key = {p.key(): p for p in problems}
    for p in problems:
        if p.kind != fp.MISSING_RANK or p.culprits:
            continue
        missing = [side["ranks"][0] for side in p.sides if side["call"] is None]
        causes = [by_key.get(_blocked_in(views[r])) for r in missing if r in views]
        causes = [c for c in causes if c is not None and c is not p]
        if missing and len(causes) == len(missing):
            p.consequence_of = f"{causes[0].op} #{causes[0].seq} on group {causes[0].group}"
            if not p.culprits:
                p.culprits, p.why = list(causes[0].culprits), f"follows from {p.consequence_of}"

