"""The pure parts: settings from the environment, fingerprints and blame, the desync
verdict over ranks' states, and call sites."""

import pytest

from plait.debug import fingerprint as fp
from plait.debug.callsite import call_site, format_site
from plait.debug.config import DebugConfig, env_asks_for_debugging
from plait.debug.desync import report, verdict


def test_config_from_env_and_what_each_level_turns_on():
    off = DebugConfig.from_env({})
    assert (off.level, off.buffer_size, off.timeout_s, off.stacks) == ("OFF", 2000, None, False)
    assert off.wants_recorder and not (off.wants_check or off.wants_watchdog or off.wants_wrap or off.wants_summary)
    info = DebugConfig.from_env({"PLAIT_DISTRIBUTED_DEBUG": "info"})
    assert info.wants_summary and info.wants_wrap and not info.wants_check and not info.wants_watchdog
    detail = DebugConfig.from_env({"PLAIT_DISTRIBUTED_DEBUG": "DETAIL", "PLAIT_COLLECTIVE_TIMEOUT": "2.5",
                                   "PLAIT_TRACE_BUFFER_SIZE": "0", "PLAIT_TRACE_STACKS": "1",
                                   "PLAIT_TRACE_DIR": "/x"})
    assert detail.wants_check and detail.wants_watchdog and detail.wants_log and not detail.wants_recorder
    assert (detail.timeout_s, detail.stacks, detail.trace_dir) == (2.5, True, "/x")
    desync = DebugConfig.from_env({"PLAIT_DESYNC_DEBUG": "1"})
    assert desync.wants_watchdog and desync.wants_wrap and not desync.wants_check
    assert env_asks_for_debugging({"PLAIT_DESYNC_DEBUG": "1"}) and not env_asks_for_debugging({"PLAIT_TRACE_STACKS": "1"})
    assert DebugConfig().replace(timeout=3, level="detail").timeout_s == 3


@pytest.mark.parametrize("env,message", [
    ({"PLAIT_DISTRIBUTED_DEBUG": "VERBOSE"}, "not one of OFF, INFO, DETAIL"),
    ({"PLAIT_DESYNC_DEBUG": "maybe"}, "PLAIT_DESYNC_DEBUG='maybe' is not 0 or 1"),
    ({"PLAIT_COLLECTIVE_TIMEOUT": "soon"}, "PLAIT_COLLECTIVE_TIMEOUT='soon' is not a number"),
    ({"PLAIT_COLLECTIVE_TIMEOUT": "-1"}, "must be > 0 seconds, got -1.0"),
    ({"PLAIT_TRACE_BUFFER_SIZE": "1.5"}, "PLAIT_TRACE_BUFFER_SIZE='1.5' is not an integer"),
])
def test_bad_settings_say_what_is_wrong(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DebugConfig.from_env(env)
    with pytest.raises(TypeError, match="unknown debug setting"):
        DebugConfig().replace(levle="DETAIL")


def _rec(op="all_reduce", shape=(4,), dtype="float32", reduce_op="sum", peer=None, out=None):
    return {"op": op, "input_shapes": [list(shape)], "input_dtypes": [dtype], "reduce_op": reduce_op, "peer": peer,
            "output_shapes": [list(out or shape)], "output_dtypes": [dtype]}


def test_fingerprints_compare_what_every_rank_must_agree_on():
    # all-gather inputs may be uneven; its output must match
    assert fp.fingerprint(_rec("all_gather", (2,), out=(5,))) == fp.fingerprint(_rec("all_gather", (3,), out=(5,)))
    assert fp.fingerprint(_rec("all_gather", (2,), out=(5,))) != fp.fingerprint(_rec("all_gather", (2,), out=(6,)))
    # all-to-all may be uneven both ways: dtypes only
    assert fp.fingerprint(_rec("all_to_all", (2,), out=(7,))) == fp.fingerprint(_rec("all_to_all", (9,), out=(1,)))
    assert fp.classify({0: fp.fingerprint(_rec("broadcast", peer=0)),
                        1: fp.fingerprint(_rec("broadcast", peer=1))}).kind == fp.OP_TYPE  # different roots
    v = fp.classify({0: fp.fingerprint(_rec()), 1: fp.fingerprint(_rec()), 2: fp.fingerprint(_rec(dtype="int64"))})
    assert (v.kind, v.culprits, [r for _, r in v.sides]) == (fp.DTYPE, [2], [[0, 1], [2]])
    assert fp.classify({0: fp.fingerprint(_rec()), 1: fp.fingerprint(_rec(shape=(5,)))}).culprits == []  # 1:1
    assert fp.describe(_rec(reduce_op="avg", shape=(2, 3))) == "all_reduce(avg) (2, 3) float32"


def test_who_is_blamed_for_a_missing_rank():
    assert fp.missing_culprits([0, 1, 2], [3], {}) == [3]  # the minority skipped it
    assert fp.missing_culprits([0], [1, 2, 3], {}) == [0]  # the minority called one too many
    assert fp.missing_culprits([0], [1], {1: "exited"}) == [0]  # the other finished: an op too many
    assert fp.missing_culprits([0], [1], {1: "running"}) == [1]  # the other is busy elsewhere: late
    assert fp.missing_culprits([0], [1], {1: "in op"}) == []  # both stuck: undecided


def _op(seq, op="all_reduce", rank=0, state="started", peer=None, ranks=(0, 1)):
    return {"id": seq * 10 + rank, "group": "0", "group_ranks": list(ranks), "rank": rank, "global_rank": rank,
            "seq": seq, "op": op, "p2p": op in ("send", "recv"), "peer": peer,
            "peer_global": None if peer is None else ranks[peer], "state": state, "time_scheduled_ns": 1,
            "site": ["t.py", seq, "f"], "input_shapes": [[4]], "input_dtypes": ["float32"],
            "output_shapes": [[4]], "output_dtypes": ["float32"], "reduce_op": "sum"}


def _state(rank, status, seq, in_flight=(), p2p=None):
    return {"rank": rank, "status": status, "error": None, "in_flight": list(in_flight), "threads": {},
            "groups": {"0": {"ranks": [0, 1], "seq": seq, "p2p": p2p or {}, "last_entered": None,
                             "last_completed": None}}}


def test_desync_verdict_follows_a_blocked_rank_to_the_real_culprit():
    """Rank 1 waits in barrier #1; rank 0 never came because it waits in send #2, which rank 1
    (having taken one recv and moved on) never matched: rank 1 is to blame."""
    send = _op(2, "send", rank=0, peer=1)
    barrier = _op(1, "barrier", rank=1)
    states = {0: _state(0, "in op", 0, [send], {"send->1": 2}), 1: _state(1, "in op", 1, [barrier], {"recv<-0": 1})}
    v = verdict(barrier, states)
    assert (v.entered, v.missing, v.culprits) == ([1], [0], [1])
    assert "rank 0 is blocked in send #2" in v.why
    v = verdict(send, states)
    assert (v.entered, v.missing, v.culprits) == ([0], [1], [1])
    text, _ = report(barrier, states, me=1, reason="barrier #1 timed out", timeout_s=3.0, dump_dir="/d")
    assert "culprit(s): [1]" in text and "t.py:2 in f" in text and "plait debug analyze /d" in text


def test_desync_verdict_with_a_rank_that_did_not_answer():
    states = {0: _state(0, "in op", 2, [_op(2)]), 1: None}
    v = verdict(_op(2), states)
    assert (v.entered, v.missing, v.unknown, v.culprits) == ([0], [], [1], [])


def test_call_site_is_the_user_line():
    def issue():
        return call_site(0)

    path, line, func = issue()
    assert path.endswith("test_units.py") and func == "issue"
    assert format_site((path, line, func)).endswith(f"test_units.py:{line} in issue")


def test_call_site_classes_each_code_object_by_identity_even_as_ids_are_reused():
    # The classification is cached by id(code): a code object freed and replaced by another
    # at the same address must not inherit its verdict. Library code (a file under
    # plait/pipelining) and user code alternate, each freed before the next is compiled.
    import os

    from plait.debug import callsite

    library = os.path.join(os.path.dirname(callsite.__file__), "..", "pipelining", "gen.py")
    library = os.path.normpath(library)
    for i in range(200):
        path = library if i % 2 else f"/tmp/user_script_{i}.py"
        code = compile("def f():\n    return g()\n", path, "exec")
        scope = {"g": lambda: call_site(1)}  # the walk starts at f
        exec(code, scope)
        site = scope["f"]()
        # from library code the site is the caller of f (this test); from user code, f itself
        assert (site[0] == __file__) == bool(i % 2), (i, path, site)
        del code, scope, site
