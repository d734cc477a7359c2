"""The analyzer on hand-made dumps: each kind of disagreement, ring-buffer eviction, p2p
streams, consequences, stale dumps of another job, and the CLI's exit status."""

import json

import pytest

from plait.debug.analyze import analyze
from plait.debug.cli import main as cli_main
from plait.debug.cli import render
from plait.debug.config import DUMP_FORMAT

T0 = 1_700_000_000_000_000_000


def entry(seq, op="all_reduce", *, rank=0, ranks=(0, 1), shape=(4,), dtype="float32", state="completed",
          peer=None, group="0", t=None, site=("train.py", 10, "main"), reduce_op="sum"):
    p2p = op in ("send", "recv")
    shapes, dtypes = [list(shape)], [dtype]
    return {
        "id": seq, "group": group, "group_ranks": list(ranks), "rank": ranks.index(rank), "global_rank": rank,
        "seq": seq, "op": op, "p2p": p2p, "peer": peer, "peer_global": None if peer is None else ranks[peer],
        "input_shapes": shapes if op != "recv" else [], "input_dtypes": dtypes if op != "recv" else [],
        "output_shapes": shapes if op != "send" else [], "output_dtypes": dtypes if op != "send" else [],
        "reduce_op": reduce_op if op == "all_reduce" else None, "bytes": 16, "impl": "native", "async_op": False,
        "state": state, "time_scheduled_ns": T0 + (t if t is not None else seq) * 1000, "time_started_ns": None,
        "time_completed_ns": None, "duration_ms": None, "site": list(site), "stack": None, "error": None,
    }


def write(tmp_path, rank, entries, *, world=2, seq=None, p2p=None, status="running", job="job-1",
          dump_time=0, where=None, reason="requested", peers=None, group_ranks=(0, 1)):
    doc = {
        "format": DUMP_FORMAT, "version": 1, "rank": rank, "world_size": world, "job_id": job, "pid": 1,
        "host": "h", "reason": reason, "dump_time_ns": T0 + 10**9 + dump_time, "status": status,
        "buffer_size": 2000, "dropped": 0,
        "groups": {"0": {"ranks": list(group_ranks), "rank": rank, "backend": "gloo",
                         "seq": seq if seq is not None else max([e["seq"] for e in entries if not e["p2p"]], default=0),
                         "p2p": p2p or {}}},
        "entries": entries,
        "threads": {"MainThread": {"where": where, "stack": ""}},
    }
    if peers:
        doc["peers"] = peers
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))


def test_matching_dumps_have_no_problem_and_exit_0(tmp_path, capsys):
    for r in (0, 1):
        write(tmp_path, r, [entry(k, rank=r) for k in (1, 2, 3)])
    assert analyze(str(tmp_path)).problems == []
    assert cli_main(["analyze", str(tmp_path)]) == 0
    assert "no disagreement found" in capsys.readouterr().out


@pytest.mark.parametrize("field,value,kind", [
    ("op", "all_gather", "op type mismatch"),
    ("shape", (5,), "size mismatch"),
    ("dtype", "bfloat16", "dtype mismatch"),
    ("reduce_op", "max", "op type mismatch"),
])
def test_each_kind_of_mismatch_names_the_odd_rank(tmp_path, field, value, kind):
    ranks = (0, 1, 2)
    for r in ranks:
        odd = {field: value} if r == 2 else {}
        write(tmp_path, r, [entry(1, rank=r, ranks=ranks), entry(2, rank=r, ranks=ranks, state="scheduled", **odd)],
              world=3, group_ranks=ranks)
    p = analyze(str(tmp_path)).first
    assert (p.kind, p.seq, p.culprits) == (kind, 2, [2])
    assert [s["ranks"] for s in p.sides] == [[0, 1], [2]]


def test_missing_rank_with_a_sleeping_culprit_and_its_location(tmp_path):
    write(tmp_path, 0, [entry(1), entry(2, state="started", site=("train.py", 20, "main"))], status="in op")
    write(tmp_path, 1, [entry(1, rank=1)], where="train.py:19 in main")
    a = analyze(str(tmp_path))
    p = a.first
    assert (p.kind, p.seq, p.culprits) == ("missing rank", 2, [1])
    text = render(a)
    assert "train.py:20 in main" in text and "now at train.py:19 in main" in text and "culprit: rank 1" in text


def test_extra_op_on_one_rank_when_the_others_exited(tmp_path):
    """Rank 0 dumped; rank 1 exited normally and is known only from rank 0's report."""
    state = {"rank": 1, "status": "exited", "error": None, "in_flight": [], "threads": {},
             "groups": {"0": {"ranks": [0, 1], "seq": 2, "p2p": {},
                              "last_entered": entry(2, rank=1), "last_completed": entry(2, rank=1)}}}
    write(tmp_path, 0, [entry(1), entry(2), entry(3, state="scheduled", site=("train.py", 30, "main"))],
          status="in op", peers={"1": state})
    a = analyze(str(tmp_path))
    assert a.ranks[1]["source"] == "report of rank 0" and a.missing_dumps == []
    p = a.first
    assert (p.kind, p.seq, p.culprits) == ("missing rank", 3, [0])
    assert p.sides[0]["site"] == "train.py:30 in main"


def test_ring_eviction_is_not_a_missing_rank(tmp_path):
    """Rank 0 kept only ops 5..6 of 6; rank 1 all of them: 1..4 are not 'missing' on rank 0."""
    write(tmp_path, 0, [entry(k) for k in (5, 6)], seq=6)
    write(tmp_path, 1, [entry(k, rank=1) for k in range(1, 7)])
    assert analyze(str(tmp_path)).problems == []


def test_state_mismatch(tmp_path):
    write(tmp_path, 0, [entry(1), entry(2, state="completed")])
    write(tmp_path, 1, [entry(1, rank=1), entry(2, rank=1, state="started")], status="in op")
    p = analyze(str(tmp_path)).first
    assert (p.kind, p.seq, p.culprits) == ("state mismatch", 2, [1])


def test_p2p_send_without_recv_blames_the_stage_that_moved_on(tmp_path):
    """Stage 0 waits in send #2; stage 1 took one recv and went on to a barrier."""
    write(tmp_path, 0, [entry(1, "send", peer=1), entry(2, "send", peer=1, state="started", t=5,
                                                         site=("pipe.py", 7, "stage0"))],
          seq=0, p2p={"send->1": 2}, status="in op")
    write(tmp_path, 1, [entry(1, "recv", rank=1, peer=0), entry(1, "barrier", rank=1, state="started", t=4)],
          seq=1, p2p={"recv<-0": 1}, status="in op")
    a = analyze(str(tmp_path))
    p = a.first
    assert (p.kind, p.op, p.seq, p.p2p, p.culprits) == ("missing rank", "send", 2, {"src": 0, "dst": 1}, [1])
    assert p.sides[0]["site"] == "pipe.py:7 in stage0"
    barrier = next(q for q in a.problems if q.op == "barrier")
    assert barrier.consequence_of == "send #2 on group 0", "rank 0 misses the barrier because of the send"


def test_p2p_shape_mismatch(tmp_path):
    write(tmp_path, 0, [entry(1, "send", peer=1, shape=(2, 3), state="started")], seq=0, p2p={"send->1": 1})
    write(tmp_path, 1, [entry(1, "recv", rank=1, peer=0, shape=(3, 2), state="started")], seq=0, p2p={"recv<-0": 1})
    p = analyze(str(tmp_path)).first
    assert (p.kind, p.p2p) == ("size mismatch", {"src": 0, "dst": 1})


def test_dumps_of_an_older_job_are_left_out(tmp_path):
    write(tmp_path, 0, [entry(1), entry(2)], job="new", dump_time=5)
    write(tmp_path, 1, [entry(1, rank=1), entry(2, rank=1)], job="new", dump_time=5)
    write(tmp_path, 2, [entry(1, rank=2, ranks=(0, 1, 2), shape=(9,))], job="old", world=3, group_ranks=(0, 1, 2))
    a = analyze(str(tmp_path))
    assert a.problems == [] and any("another job" in w for w in a.warnings)


def test_cli_exit_status_and_json(tmp_path, capsys):
    assert cli_main(["analyze", str(tmp_path / "nothing-here")]) == 2
    write(tmp_path, 0, [entry(1), entry(2, state="started")], status="in op")
    write(tmp_path, 1, [entry(1, rank=1)], where="x.py:3 in f")
    capsys.readouterr()
    assert cli_main(["analyze", str(tmp_path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first"]["kind"] == "missing rank" and out["first"]["culprits"] == [1]
    assert out["world_size"] == 2 and out["missing_dumps"] == []
