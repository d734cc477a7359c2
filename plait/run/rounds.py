"""The records of a rendezvous round: who is in it, and how it ended.

    NodeInfo ×N ──close──▶ RoundInfo (nodes in group-rank order, restarts used so far)
    first node to see a reason ──end──▶ RoundEnd (reason, restarts used, final?) — one per round

A round is one attempt of the job. Exactly one RoundEnd is written per round (compare-and-set on
the store), and it carries the decision every agent follows: restart with a fresh round, or stop
for good. Restarts are therefore counted once per job, not once per node (pytorch#108158), and
two nodes seeing the same failure cannot spend two restarts on it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class NodeInfo:
    """What an agent tells the others when it joins a round."""

    node_id: str  # unique per agent process: host, pid and a random suffix
    name: str  # for people: the host name, or --local-addr
    addr: str  # where other nodes reach this one (MASTER_ADDR when it is group rank 0)
    nproc: int
    node_rank: int  # --node-rank (static); the ordering key there
    prev_group_rank: int | None  # keeps survivors' ranks stable across restarts
    worker_port: int  # the socket it bound for this round's worker store

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NodeInfo:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RoundInfo:
    """One closed round as this node sees it."""

    round: int
    group_rank: int
    nodes: tuple[NodeInfo, ...]  # in group-rank order
    restarts: int  # failure restarts the job used before this round

    @property
    def me(self) -> NodeInfo:
        return self.nodes[self.group_rank]

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def rank_offset(self) -> int:
        """Global rank of this node's local rank 0: ranks are contiguous per node."""
        return sum(n.nproc for n in self.nodes[: self.group_rank])

    @property
    def master_addr(self) -> str:
        return self.nodes[0].addr

    @property
    def master_port(self) -> int:
        return self.nodes[0].worker_port


class EndReason(str, enum.Enum):
    SUCCESS = "success"  # every worker on every node exited 0
    FAILURE = "failure"  # a worker failed
    NODE_LOST = "node_lost"  # an agent stopped heartbeating
    NODE_LEFT = "node_left"  # an agent was told to stop (signal)
    MEMBERSHIP = "membership"  # a node is waiting to join and there is room: regroup, no restart spent


@dataclass(frozen=True)
class RoundEnd:
    round: int
    reason: EndReason
    restarts: int  # failure restarts the job has used, this one included
    final: bool  # True: no next round, the job is over
    by: str  # the node that ended the round
    detail: str  # one line for people
    failure: dict | None = None  # the root cause, an errors.Failure as JSON

    @classmethod
    def decide(
        cls, *, round: int, reason: EndReason, restarts_before: int, max_restarts: int,
        by: str, detail: str, failure: dict | None = None, final: bool = False,
    ) -> RoundEnd:
        """The end of a round and what follows it; `final=True` ends the job whatever the reason."""
        if reason is EndReason.SUCCESS:
            restarts, final = restarts_before, True
        elif reason is EndReason.MEMBERSHIP:
            restarts, final = restarts_before, False
        else:
            restarts = restarts_before + 1
            final = final or restarts > max_restarts
        return cls(round, reason, restarts, final, by, detail, failure)

    @property
    def succeeded(self) -> bool:
        return self.reason is EndReason.SUCCESS

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "reason": self.reason.value})

    @classmethod
    def from_json(cls, text: str) -> RoundEnd:
        data = json.loads(text)
        return cls(**{**data, "reason": EndReason(data["reason"])})
