"""DETAIL: before a collective runs, the ranks of its group compare fingerprints.

    on_start(event) -> set fp/<group>/<seq>/<rank> -> wait for the other members' keys
      -> all agree: the op runs; delete this rank's key of the previous op (every member
         has read it: none can post op k before it has passed op k-1)
      -> any differ: CollectiveMismatchError on every rank, listing what each rank called
         and where; nothing is sent
      -> a member never posts: CollectiveTimeoutError after the timeout (by then the
         watchdog has normally reported and ended the process)

Every member reads every fingerprint, so every member reaches the same verdict and raises
the same error: the group stays in step.

A send and its recv are checked without waiting (an isend must never block on its peer):

    p2p/<group>/<src>-><dst>/<k>: each side sets its fingerprint, then adds 1 to a counter
      -> counter 1: the peer has not come yet; it will compare (the op runs)
      -> counter 2: the peer's fingerprint is there (set before its add): compare, clean up;
         a mismatch raises on this rank before it sends or receives, and leaves the peer
         waiting for its watchdog
"""

from __future__ import annotations

import time

from plait.comm.events import CommEvent
from plait.debug import channel
from plait.debug.callsite import Site, format_site
from plait.debug.fingerprint import Disagreement, classify, describe, fingerprint


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group called different collectives at the same point."""

    def __init__(self, message: str, *, group: str, seq: int, disagreement: Disagreement,
                 calls: dict[int, dict]) -> None:
        super().__init__(message)
        self.group, self.seq, self.disagreement, self.calls = group, seq, disagreement, calls
        self.kind, self.culprits = disagreement.kind, disagreement.culprits


class CollectiveTimeoutError(RuntimeError):
    """Some ranks of a group never reached a collective within the timeout."""


class ConsistencyCheck:
    def __init__(self) -> None:
        # group -> (seq, {rank: site}) of the first op whose call sites differed although its
        # fingerprints agreed: legal (ranks may call the same op from different lines), but
        # where a silently re-paired collective shows itself first
        self.first_divergence: dict[str, tuple[int, dict[int, str]]] = {}

    def before(self, event: CommEvent, site: Site | None, timeout_s: float) -> None:
        n = len(event.group_ranks)
        if event.op in ("send", "recv"):
            self._before_p2p(event, site)
            return
        if n == 1:
            return
        mine = fingerprint(event)
        mine.update(site=format_site(site), rank=event.group_ranks[event.rank])
        key = f"fp/{event.group_name}/{event.seq}"
        others = [f"{key}/{r}" for r in range(n) if r != event.rank]
        with channel.store() as store:
            channel.put_json(store, f"{key}/{event.rank}", mine)
            if not channel.wait(store, others, timeout_s):
                present = channel.present(store, others)
                missing = [r for r, p in zip((r for r in range(n) if r != event.rank), present) if not p]
                raise CollectiveTimeoutError(self._timeout_message(event, mine, missing, timeout_s))
            calls = {event.rank: mine}
            for k, value in zip(others, channel.get_json(store, others)):
                calls[int(k.rsplit("/", 1)[1])] = value
            verdict = classify({r: fp for r, fp in calls.items()})
            if verdict is not None:
                raise CollectiveMismatchError(self._mismatch_message(event, calls, verdict),
                                              group=event.group_name, seq=event.seq,
                                              disagreement=verdict, calls=calls)
            if event.group_name not in self.first_divergence and len({c["site"] for c in calls.values()}) > 1:
                self.first_divergence[event.group_name] = (event.seq, {r: c["site"] for r, c in calls.items()})
            store.delete_key(f"fp/{event.group_name}/{event.seq - 1}/{event.rank}")

    def _before_p2p(self, event: CommEvent, site: Site | None) -> None:
        me, peer = event.rank, event.peer
        if peer is None or peer < 0:
            return  # a recv from any source: nothing to pair with
        src, dst = (me, peer) if event.op == "send" else (peer, me)
        key = f"p2p/{event.group_name}/{src}->{dst}/{event.seq}"
        mine = fingerprint(event)
        mine.update(site=format_site(site), rank=event.group_ranks[me], kind=event.op)
        other_kind = "recv" if event.op == "send" else "send"
        with channel.store() as store:
            channel.put_json(store, f"{key}/{event.op}", mine)
            if store.add(f"{key}/n", 1) < 2:
                return
            other = channel.get_json(store, [f"{key}/{other_kind}"])[0]
            for suffix in ("send", "recv", "n"):
                store.delete_key(f"{key}/{suffix}")
        calls = {me: mine, peer: other}
        verdict = classify(calls)
        if verdict is not None:
            ranks = event.group_ranks
            lines = [f"point-to-point mismatch on group {event.group_name}: {other_kind if event.op == 'recv' else 'send'} "
                     f"#{event.seq} from rank {ranks[src]} to rank {ranks[dst]}: {verdict.kind}"]
            for r in (src, dst):
                c = calls[r]
                lines.append(f"  rank {ranks[r]}: {c['kind']} {describe(c).removeprefix('send/recv ')}  at {c['site']}")
            lines.append(f"Rank {ranks[me]} stops before its {event.op}; rank {ranks[peer]} is left waiting "
                         f"(PLAIT_DISTRIBUTED_DEBUG=DETAIL).")
            raise CollectiveMismatchError("\n".join(lines), group=event.group_name, seq=event.seq,
                                          disagreement=verdict, calls=calls)

    def _mismatch_message(self, event: CommEvent, calls: dict[int, dict], verdict: Disagreement) -> str:
        ranks = event.group_ranks
        lines = [
            f"collective mismatch on group {event.group_name} (global ranks {list(ranks)}) at op "
            f"#{event.seq}: {verdict.kind}",
        ]
        width = max(len(describe(c)) for c in calls.values())
        for r in sorted(calls):
            lines.append(f"  rank {ranks[r]}: {describe(calls[r]):<{width}}  at {calls[r]['site']}")
        if verdict.culprits:
            lines.append(f"odd one out: global rank(s) {[ranks[r] for r in verdict.culprits]}")
        else:
            lines.append("the ranks split evenly: compare the call sites above")
        lines.append("Nothing was sent: every rank of the group raises this error (PLAIT_DISTRIBUTED_DEBUG=DETAIL).")
        return "\n".join(lines)

    def _timeout_message(self, event: CommEvent, mine: dict, missing: list[int], timeout_s: float) -> str:
        ranks = event.group_ranks
        lines = [
            f"{describe(mine)} (op #{event.seq} on group {event.group_name}, global ranks {list(ranks)}) "
            f"at {mine['site']}: global rank(s) {[ranks[r] for r in missing]} did not reach it "
            f"within {timeout_s:.1f} s",
        ]
        lines += self.divergence_hint(event.group_name, ranks)
        return "\n".join(lines)

    def divergence_hint(self, group: str, ranks: tuple[int, ...]) -> list[str]:
        if group not in self.first_divergence:
            return []
        seq, sites = self.first_divergence[group]
        lines = [f"hint: call sites first differed at op #{seq} of group {group} (fingerprints matched):"]
        lines += [f"  rank {ranks[r]}: {s}" for r, s in sorted(sites.items())]
        return lines


def remaining(event: CommEvent, timeout_s: float) -> float:
    """Seconds left of the op's timeout, counted from when it was issued."""
    return timeout_s - (time.perf_counter_ns() - event.start_ns) / 1e9
