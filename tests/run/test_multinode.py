"""Several agents on one machine, as separate nodes over loopback: rendezvous, Gloo, loss, late join."""

from __future__ import annotations

import os
import re
import signal

from tests.run.conftest import free_port, port_is_free, worker
from tests.run.workers._common import HANG_S

# short timeouts: a last call takes 1 s and a lost node is noticed in 8 s, not minutes. Shorter
# than that, a loaded machine that starves an agent's heartbeat thread for a few seconds makes
# a live node look lost. The join timeout only bounds a hang, but the first agent's window
# includes every later agent's start-up (python, torch's import: ~60 s seen under ci-under-load
# -j 2), so it is HANG_S, the bound the test's own waits use: at 120 s a starved second agent
# joined after the host had given up, and no worker of round 0 ever started.
FAST = (f"join_timeout={HANG_S:.0f},last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=16,"
        "close_timeout=10")


def c10d(port: int, nnodes: str, *more: str) -> list[str]:
    return ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "job", "--rdzv-conf", FAST, *more]


def ranks_printed(out: str) -> list[int]:
    return sorted({int(m) for m in re.findall(r"^\[\S+ rank (\d+)\] ", out, re.M)})


def test_agents_form_one_gloo_group_with_contiguous_ranks_per_node(job):
    port = free_port()
    a = job.start(*c10d(port, "2"), "--nproc-per-node", "2", worker("gloo_allreduce.py"))
    b = job.start(*c10d(port, "2"), "--nproc-per-node", "1", worker("gloo_allreduce.py"))
    ra, rb = a.wait(), b.wait()
    assert ra.rc == 0 and rb.rc == 0, ra.err + rb.err
    assert job.outputs("allreduce_") == ["allreduce_a0_r0", "allreduce_a0_r1", "allreduce_a0_r2"]
    assert {job.read(n)["sum"] for n in job.outputs("allreduce_")} == {6.0}  # 1 + 2 + 3 over three ranks
    ranks_a, ranks_b = ranks_printed(ra.out), ranks_printed(rb.out)
    assert len(ranks_a) == 2 and len(ranks_b) == 1 and sorted(ranks_a + ranks_b) == [0, 1, 2]
    assert ranks_a in ([0, 1], [1, 2])  # contiguous per node
    assert port_is_free(port)


def test_static_rendezvous_orders_nodes_by_node_rank(job):
    port = free_port()
    static = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", str(port), "--rdzv-conf", FAST]
    second = job.start(*static, "--node-rank", "1", worker("env_dump.py"))  # starts first, still node 1
    first = job.start(*static, "--node-rank", "0", worker("env_dump.py"))
    r1, r0 = second.wait(), first.wait()
    assert r0.rc == 0 and r1.rc == 0, r0.err + r1.err
    envs = {r: job.read(f"env_a0_r{r}.json") for r in range(4)}
    assert [envs[r]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert [envs[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert {envs[r]["WORLD_SIZE"] for r in range(4)} == {"4"} and {envs[r]["GROUP_WORLD_SIZE"] for r in range(4)} == {"2"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()}) == 1
    assert ranks_printed(r0.out) == [0, 1] and ranks_printed(r1.out) == [2, 3]


def start_three(job, port: int, *args: str, env=None):
    host = job.start(*args, env=env)
    host.wait_for_stderr("serving the rendezvous store")
    return [host, job.start(*args, env=env), job.start(*args, env=env)]


def test_killed_agent_survivors_regroup_with_fewer_nodes(job):
    port = free_port()
    args = [*c10d(port, "2:3", "--max-restarts", "1"), "--nproc-per-node", "1", worker("elastic.py")]
    agents = start_three(job, port, *args, env={"RELEASE_WORLD": "2"})
    job.wait_for_outputs("running_", 3, suffix="_w3")  # a round with all three nodes runs
    os.kill(agents[2].pid, signal.SIGKILL)  # not the store's host; its worker dies with it
    (job.out / "RELEASE").touch()
    r0, r1 = agents[0].wait(), agents[1].wait()
    assert r0.rc == 0 and r1.rc == 0, r0.err + r1.err
    for r in (r0, r1):
        assert "lost: no heartbeat for" in r.err and "restarting every worker (restart 1 of 1)" in r.err
        assert "2 node(s), world size 2" in r.err
    assert len(job.outputs("running_", suffix="_w2")) >= 2
    assert port_is_free(port)


def test_losing_a_node_below_the_minimum_exits_with_a_clear_message(job):
    port = free_port()
    args = [*c10d(port, "2", "--max-restarts", "1"), "--nproc-per-node", "1", worker("elastic.py")]
    host = job.start(*args)
    host.wait_for_stderr("serving the rendezvous store")
    other = job.start(*args)
    job.wait_for_outputs("running_a0_", 2)
    os.kill(other.pid, signal.SIGKILL)
    r = host.wait()
    assert r.rc == 1
    assert "only 1 node(s) remain for round 1, fewer than the minimum of 2 (--nnodes); lost:" in r.err, r.err


def test_killing_the_store_host_ends_the_job_everywhere(job):
    port = free_port()
    args = [*c10d(port, "2"), "--nproc-per-node", "1", worker("elastic.py")]
    host = job.start(*args)
    host.wait_for_stderr("serving the rendezvous store")
    other = job.start(*args)
    job.wait_for_outputs("running_a0_", 2)
    os.kill(host.pid, signal.SIGKILL)
    r = other.wait()
    assert r.rc == 1 and f"lost the rendezvous store at 127.0.0.1:{port}" in r.err, r.err


def test_late_node_joins_the_next_round_without_spending_a_restart(job):
    port = free_port()
    args = [*c10d(port, "2:3"), "--nproc-per-node", "1", worker("elastic.py")]  # --max-restarts 0
    host = job.start(*args, env={"RELEASE_WORLD": "3"})
    host.wait_for_stderr("serving the rendezvous store")
    second = job.start(*args, env={"RELEASE_WORLD": "3"})
    job.wait_for_outputs("running_a0_", 2)  # round 0 closed with two nodes
    (job.out / "RELEASE").touch()
    late = job.start(*args, env={"RELEASE_WORLD": "3"})
    results = [a.wait() for a in (host, second, late)]
    assert [r.rc for r in results] == [0, 0, 0], "".join(r.err for r in results)
    assert job.outputs("running_a1_") == ["running_a1_r0_w3", "running_a1_r1_w3", "running_a1_r2_w3"]
    assert "regrouping: 1 more node(s) asked to join" in results[0].err
