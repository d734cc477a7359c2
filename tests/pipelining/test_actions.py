"""Actions speak torch's string form, are immutable and hashable."""

import pytest

from plait.pipelining.schedules import Action, ActionType
from plait.pipelining.schedules.actions import B, F, I, W


@pytest.mark.parametrize(
    "text, action",
    [
        ("1F0", Action(1, ActionType.F, 0)),
        ("2I1", Action(2, ActionType.I, 1)),
        ("0W0", Action(0, ActionType.W, 0)),
        ("12B34", Action(12, ActionType.B, 34)),
        ("0SEND_F3", Action(0, ActionType.SEND_F, 3)),
        ("1RECV_F3", Action(1, ActionType.RECV_F, 3)),
        ("3SEND_B0", Action(3, ActionType.SEND_B, 0)),
        ("2RECV_B0", Action(2, ActionType.RECV_B, 0)),
        ("1UNSHARD", Action(1, ActionType.UNSHARD)),
        ("1REDUCE_GRAD", Action(1, ActionType.REDUCE_GRAD)),
    ],
)
def test_parse_and_format_are_inverses(text, action):
    assert Action.parse(text) == action
    assert str(action) == text
    assert Action.parse(f"  {text} ") == action


@pytest.mark.parametrize("text", ["", "F0", "1X0", "1F", "1SEND_F", "1UNSHARD2", "-1F0", "1F0x"])
def test_parse_rejects_malformed(text):
    with pytest.raises(ValueError):
        Action.parse(text)


def test_actions_are_immutable_hashable_and_unpack():
    a = F(1, 2)
    assert {a: "x"}[Action(1, "F", 2)] == "x"
    assert len({F(0, 0), F(0, 0), B(0, 0)}) == 2
    with pytest.raises(AttributeError):
        a.stage = 3
    stage, kind, mb = a
    assert (stage, kind, mb) == (1, ActionType.F, 2)
    assert a.is_compute and not a.is_comm
    assert I(0, 1).kind.is_backward and not W(0, 1).kind.is_backward


def test_comm_actions_know_their_peer_stage():
    assert Action(2, ActionType.SEND_F, 0).peer_stage == 3
    assert Action(2, ActionType.RECV_F, 0).peer_stage == 1
    assert Action(2, ActionType.SEND_B, 0).peer_stage == 1
    assert Action(2, ActionType.RECV_B, 0).peer_stage == 3
    with pytest.raises(ValueError):
        _ = F(0, 0).peer_stage
