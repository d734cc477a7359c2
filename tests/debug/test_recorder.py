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


def test_a_ring_of_tuples_and_entries_reads_as_entries_in_order():
    """The session's hot path puts (id, event, site, stack, t_started) tuples (the recorder
    alone); a session with checks records Entries: both read back as Entries, oldest first,
    with their ids, and the ring's bound and drop count hold across both."""
    from plait.debug.recorder import ENTRY_IDS, Entry, FlightRecorder

    def event(seq):
        return events.CommEvent(op="all_reduce", group_name="g", group_ranks=(0, 1), rank=0, seq=seq,
                                input_shapes=((2,),), input_dtypes=(torch.float32,), output_shapes=((2,),),
                                output_dtypes=(torch.float32,), bytes_sent=8)

    rec = FlightRecorder(3)
    for seq in range(1, 5):
        if seq % 2:
            rec.append((next(ENTRY_IDS), event(seq), ("f.py", seq, "fn"), None, 7))
            rec.total += 1
        else:
            rec.record(event(seq), ("f.py", seq, "fn"))
    got = rec.entries()
    assert all(type(e) is Entry for e in got) and [e.seq for e in got] == [2, 3, 4]
    assert [e.id for e in got] == sorted(e.id for e in got) and rec.dropped == 1
    assert got[1].t_started == 7 and got[1].state == "started" and got[0].state == "scheduled"
    assert [d["site"] for d in rec.snapshot()] == [["f.py", 2, "fn"], ["f.py", 3, "fn"], ["f.py", 4, "fn"]]
