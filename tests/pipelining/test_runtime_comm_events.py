"""The runtime's p2p stays visible at plait.comm's door, and its compiled program matches
the lowered list it came from.

A listener installed for one step sees exactly one `send` event per tensor the rank's
lowered list sends and one `recv` per tensor it receives, each to or from the peer that
runs the neighbouring stage, with per-peer sequence numbers that count on without gaps,
and every one completed by the time `step()` returns. The program (program.py) is pure
logic: every RECV gets its own slot, read by the one compute that consumes it.
"""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.comm import events
from plait.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleZBVZeroBubble,
    build_schedule,
    lower,
)
from plait.pipelining.program import Compute, Post, compile_program
from plait.pipelining.schedules import ActionType
from plait.testing import distributed


class _Recorder(events.CommListener):
    def __init__(self) -> None:
        self.started: list[events.CommEvent] = []

    def on_start(self, event: events.CommEvent) -> None:
        self.started.append(event)


def _expected(schedule, rank: int) -> dict[tuple[str, int], int]:
    """(kind, peer) -> transfers in this rank's lowered list (one tensor each here)."""
    lowered = schedule._runtime.plan(True)
    counts: dict[tuple[str, int], int] = {}
    for a in lowered.actions[rank]:
        if a.is_comm:
            kind = "send" if a.kind in (ActionType.SEND_F, ActionType.SEND_B) else "recv"
            key = (kind, lowered.stage_to_rank[a.peer_stage])
            counts[key] = counts.get(key, 0) + 1
    return counts


@distributed([2])
def test_every_p2p_op_of_a_step_passes_the_door():
    rank = comm.get_rank(comm.world_group())
    torch.manual_seed(0)
    m = 4
    for name in ("1F1B", "ZBVZeroBubble"):
        if name == "1F1B":
            num_stages, owned = 2, [rank]
            stage = PipelineStage(nn.Linear(4, 4), rank, num_stages, "cpu")
            schedule = Schedule1F1B(stage, m, loss_fn=nn.functional.mse_loss)
        else:
            num_stages, owned = 4, [rank, 3 - rank]
            stages = [PipelineStage(nn.Linear(4, 4), s, num_stages, "cpu") for s in owned]
            schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=nn.functional.mse_loss)
        x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
        args = (x,) if 0 in owned else ()
        target = y if num_stages - 1 in owned else None
        schedule.step(*args, target=target)  # the first step exchanges shapes
        recorder = _Recorder()
        with events.listening(recorder):
            schedule.step(*args, target=target)
        seen: dict[tuple[str, int], list[int]] = {}
        for e in recorder.started:
            assert e.op in ("send", "recv"), e.op
            assert e.completed, f"{name}: {e.op} #{e.seq} to/from {e.peer} not completed"
            seen.setdefault((e.op, e.peer), []).append(e.seq)
        expected = _expected(schedule, rank)
        assert {k: len(v) for k, v in seen.items()} == expected, (name, seen, expected)
        for key, seqs in seen.items():
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (name, key, seqs)


def test_program_gives_each_receive_one_slot_read_by_its_consumer():
    for name, p, v in (("1F1B", 2, None), ("Interleaved1F1B", 2, 2), ("ZBVZeroBubble", 2, 2)):
        lowered = lower(build_schedule(name, p, 8, stages_per_rank=v))
        for rank in range(p):
            stages = {s: _FakeStage(s) for s in lowered.stages_of(rank)}
            program = compile_program(lowered.actions[rank], stages)
            written, read = {}, {}
            for i, op in enumerate(program.ops):
                if isinstance(op, Post):
                    for t in op.transfers:
                        if t.slot >= 0:
                            assert t.slot not in written, (name, rank, t)
                            written[t.slot] = (i, t.action)
                else:
                    assert isinstance(op, Compute)
                    if op.wait >= 0:
                        assert op.wait not in read, (name, rank, op)
                        read[op.wait] = (i, op.action)
            assert sorted(written) == sorted(read) == list(range(program.num_slots)), name
            for slot, (i, recv) in written.items():
                j, consumer = read[slot]
                assert i < j and (recv.stage, recv.microbatch) == (consumer.stage, consumer.microbatch)
            computes = [a for a in lowered.actions[rank] if a.is_compute]
            assert [op.action for op in program.ops if isinstance(op, Compute)] == computes


class _FakeStage:
    """Only what compile_program reads: the four op builders."""

    def __init__(self, s: int) -> None:
        self.stage_index = s
        self.fwd_send_ops = self.fwd_recv_ops = self.bwd_send_ops = self.bwd_recv_ops = list
