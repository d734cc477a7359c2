"""The flight recorder: on by default, a bounded ring, what an entry holds, dumps on
request; and OFF with the recorder off installs nothing at the door."""

import json

import torch

from plait import comm, debug
from plait.comm import events
from plait.debug import session
from plait.testing import distributed


@distributed([2])
def test_on_by_default_and_dumped_on_request(tmp_path):
    assert session.current_config().buffer_size == 2000, "the recorder is on with no PLAIT_* set"
    g = comm.world_group()
    with debug.configured(trace_dir=str(tmp_path)):
        comm.all_reduce(torch.ones(2, 3), group=g, op="max")  # the line
        h = comm.all_gather(torch.ones(2, dtype=torch.bfloat16), group=g, async_op=True)
        path = debug.dump_flight_recorder()
        h.wait()
    doc = json.loads(open(path).read())
    rank = comm.get_rank(g)
    assert path.endswith(f"rank{rank}.json") and doc["rank"] == rank and doc["world_size"] == 2
    assert doc["reason"] == "requested" and doc["groups"][g.group_name]["ranks"] == [0, 1]
    ar, ag = doc["entries"][-2:]
    assert (ar["op"], ar["reduce_op"], ar["input_shapes"], ar["input_dtypes"]) == ("all_reduce", "max", [[2, 3]], ["float32"])
    assert ar["state"] == "completed" and ar["time_completed_ns"] >= ar["time_scheduled_ns"]
    assert ar["seq"] + 1 == ag["seq"] and ag["output_shapes"] == [[4]] and ag["output_dtypes"] == ["bfloat16"]
    assert ar["site"][0].endswith("test_recorder.py") and ar["stack"] is None
    assert "MainThread" in doc["threads"] and "test_recorder.py" in doc["threads"]["MainThread"]["stack"]


@distributed([2])
def test_ring_keeps_the_last_n_with_stacks_when_asked(tmp_path):
    g = comm.world_group()
    with debug.configured(buffer_size=5, stacks=True, trace_dir=str(tmp_path)):
        for i in range(8):
            comm.broadcast(torch.full((i + 1,), 1.0), src=0, group=g)
        doc = json.loads(open(debug.dump_flight_recorder()).read())
    assert doc["buffer_size"] == 5 and doc["dropped"] == 3 and len(doc["entries"]) == 5
    assert [e["input_shapes"] for e in doc["entries"]] == [[[i + 1]] for i in range(3, 8)]
    stack = doc["entries"][-1]["stack"]
    assert stack[0][0].endswith("test_recorder.py") and stack[0][2] == "test_ring_keeps_the_last_n_with_stacks_when_asked"


@distributed([2])
def test_off_with_no_recorder_installs_nothing_at_the_door():
    g = comm.world_group()
    with debug.configured(level="OFF", buffer_size=0):
        assert session.session() is None
        assert events._listeners == (), "the door builds no event"
        with debug.CommDebugMode() as mode:  # other listeners are unaffected
            comm.all_reduce(torch.ones(2), group=g)
        assert mode.get_total_counts() == 1
    assert isinstance(events._debug, session.Session), "the default recorder is back"
    assert comm.listeners() == (), "plait.debug's session is not one of the listeners users add"
