"""Point-to-point ops: send, recv, their async forms, and batches of them.

    P2POp(kind, tensor, peer) ... -> batch_isend_irecv(ops) -> [Handle per op]

Peers are ranks within the group. Sequence numbers count per (direction, peer), so the
n-th send from a to b is matched with b's n-th receive from a.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait.comm import _c10d, checks, events
from plait.comm.eager import eager_only
from plait.comm.group import GroupInfo, group_info
from plait.comm.work import Handle


@dataclass(frozen=True)
class P2POp:
    """One half of a transfer for `batch_isend_irecv`: kind is "send" or "recv" (or the
    functions `isend`/`irecv`, as torch spells it)."""

    kind: Any
    tensor: torch.Tensor
    peer: int
    group: ProcessGroup

    def __post_init__(self) -> None:
        if self.kind == "send" or self.kind == "recv":  # the runtime's spelling: nothing to do
            return
        kind = {isend: "send", irecv: "recv"}.get(self.kind, self.kind)
        if kind not in ("send", "recv"):
            raise ValueError(f"P2POp kind must be 'send', 'recv', isend or irecv, got {self.kind!r}")
        object.__setattr__(self, "kind", kind)


def _begin(kind: str, tensor: torch.Tensor, peer: int, info: GroupInfo, async_op: bool) -> events.CommEvent | None:
    key = (kind, peer)
    seq = info.p2p_seq[key] = info.p2p_seq.get(key, 0) + 1
    if not events._listeners:
        return None
    shape = (tuple(tensor.shape),)
    event = events.CommEvent(
        op=kind, group_name=info.name, group_ranks=info.ranks, rank=info.rank, seq=seq,
        input_shapes=shape if kind == "send" else (), input_dtypes=(tensor.dtype,) if kind == "send" else (),
        output_shapes=shape if kind == "recv" else (), output_dtypes=(tensor.dtype,) if kind == "recv" else (),
        bytes_sent=tensor.numel() * tensor.element_size() if kind == "send" else 0,
        peer=peer, async_op=async_op,
    )
    events.emit_start(event)
    return event


def _prepare(
    kind: str, tensor: torch.Tensor, peer: int, group: ProcessGroup, info: GroupInfo | None = None
) -> tuple[GroupInfo, torch.Tensor]:
    info = group_info(group) if info is None else info
    checks.tensor(tensor, "tensor", info, in_place=kind == "recv")
    checks.peer(peer, info, "dst" if kind == "send" else "src")
    wire = tensor.contiguous()
    if not checks.is_native(wire.dtype, info.backend):
        wire = wire.view(-1).view(torch.uint8)
    return info, wire


@eager_only
def isend(tensor: torch.Tensor, *, dst: int, group: ProcessGroup) -> Handle:
    """Start sending `tensor` to group rank `dst`; don't modify it until the handle completes."""
    info, wire = _prepare("send", tensor, dst, group)
    event = _begin("send", tensor, dst, info, True)
    work = _c10d.isend(wire, group=group, group_dst=dst)
    return Handle(work, lambda keep=wire: None, event)  # keep the wire copy alive until done


@eager_only
def irecv(tensor: torch.Tensor, *, src: int, group: ProcessGroup) -> Handle:
    """Start receiving into `tensor` from group rank `src`; the handle's result is `tensor`."""
    info, wire = _prepare("recv", tensor, src, group)
    event = _begin("recv", tensor, src, info, True)
    work = _c10d.irecv(wire, group=group, group_src=src)
    return Handle(work, lambda: tensor, event)


@eager_only
def send(tensor: torch.Tensor, *, dst: int, group: ProcessGroup) -> None:
    """Send `tensor` to group rank `dst` and wait until it has left."""
    info, wire = _prepare("send", tensor, dst, group)
    event = _begin("send", tensor, dst, info, False)
    _c10d.send(wire, group=group, group_dst=dst)  # waited in C++: no Python-held Work
    Handle(None, lambda: None, event).wait()


@eager_only
def recv(tensor: torch.Tensor, *, src: int, group: ProcessGroup) -> torch.Tensor:
    """Receive into `tensor` from group rank `src`; return it."""
    info, wire = _prepare("recv", tensor, src, group)
    event = _begin("recv", tensor, src, info, False)
    _c10d.recv(wire, group=group, group_src=src)
    return Handle(None, lambda: tensor, event).wait()


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


@eager_only
def batch_isend_irecv(ops: Sequence[P2POp]) -> list[Handle]:
    """Start every op of the batch together (coalesced where the backend can) and return
    one handle per op, in order. Every op of a batch must use the same group.

    Every op is checked (and shown to the listeners) before any is issued. Gloo does not
    coalesce p2p: its ops are issued one by one on the group, as c10d's own batch does for
    it, without that batch's per-call bookkeeping (the pipeline runtime posts one batch per
    transfer)."""
    if not ops:
        return []
    group = ops[0].group
    for op in ops:
        if op.group is not group and op.group.group_name != group.group_name:
            names = sorted({o.group.group_name for o in ops})
            raise ValueError(f"batch_isend_irecv got ops on {len(names)} groups {names}; use one group per batch")
    info = group_info(group)
    prepared = []
    for op in ops:
        _, wire = _prepare(op.kind, op.tensor, op.peer, group, info)
        prepared.append((op, wire, _begin(op.kind, op.tensor, op.peer, info, True)))
    if info.backend == "gloo":
        # The group's own send/recv, what c10d's isend/irecv end in: the peer is a group
        # rank and the group is one this rank is in (both checked above); complex goes as
        # its real view, as c10d's wrappers send it.
        works = [
            group.send([_real(wire)], op.peer, 0) if op.kind == "send"
            else group.recv([_real(wire)], op.peer, 0)
            for op, wire, _ in prepared
        ]
    else:
        c10d_ops = [
            _c10d.P2POp(_c10d.isend if op.kind == "send" else _c10d.irecv, wire, group=group, group_peer=op.peer)
            for op, wire, _ in prepared
        ]
        works = _c10d.batch_isend_irecv(c10d_ops)
        if len(works) != len(ops):  # NCCL coalesces a batch into one work
            works = [works[-1]] * len(ops)
    return [
        Handle(work, (lambda t=op.tensor: t) if op.kind == "recv" else (lambda keep=wire: None), event)
        for work, (op, wire, event) in zip(works, prepared)
    ]
