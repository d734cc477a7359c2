"""Bad input ends at once with a message that names what is wrong — never a hang."""

from __future__ import annotations

import socket
import time

import pytest

from plait.run.config import RDZV_CONF_DEFAULTS
from tests.run.conftest import free_port, worker


@pytest.mark.parametrize("argv, message", [
    (["no_such_script.py"], "plait run: error: script 'no_such_script.py' not found"),
    (["--nproc-per-node", "0", worker("env_dump.py")], "--nproc-per-node 0: a node needs at least 1 worker"),
    (["--nnodes", "2:1", worker("env_dump.py")], "--nnodes 2:1: the minimum (2) is larger than the maximum (1)"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:http", worker("env_dump.py")],
     "--rdzv-endpoint 'node0:http': port 'http' is not a number"),
])
def test_bad_invocation_exits_2_with_the_reason(job, argv, message):
    t0 = time.monotonic()
    r = job.run(*argv)
    assert r.rc == 2 and message in r.err, r.err
    # refused before any wait: well within the launcher's shortest default wait (the 30 s last
    # call), however much a loaded machine slows the interpreter's start
    assert time.monotonic() - t0 < RDZV_CONF_DEFAULTS["last_call_timeout"]
    assert job.registered_pids() == []  # no worker was started


def test_master_port_in_use_names_the_address_and_port(job):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = job.run("--nproc-per-node", "2", "--master-port", str(port), worker("env_dump.py"))
    assert r.rc == 2
    assert f"--master-port 127.0.0.1:{port}: port {port} on 127.0.0.1 is already in use" in r.err, r.err
    assert job.registered_pids() == []


def test_rendezvous_port_held_by_something_else_is_reported_not_waited_on(job):
    """A c10d endpoint whose port is taken by a program that is not a store: bounded, and said so."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        t0 = time.monotonic()
        r = job.run("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-conf", "join_timeout=1", worker("env_dump.py"))
    assert r.rc == 1
    assert f"127.0.0.1:{port} accepted a connection but never answered as a c10d store" in r.err, r.err
    # bounded by join_timeout=1 (plus torch's import), not by the 600 s default join timeout;
    # half of it, because with both cores busy the run took 69 s (ci-under-load -j 2)
    assert time.monotonic() - t0 < RDZV_CONF_DEFAULTS["join_timeout"] / 2


def test_static_master_port_in_use_on_node_rank_0(job):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = job.run("--nnodes", "2", "--node-rank", "0", "--master-port", str(port), worker("env_dump.py"))
    assert r.rc == 2
    assert f"127.0.0.1:{port}: port {port} on this machine is already in use" in r.err, r.err


def test_rendezvous_timeout_says_how_many_nodes_joined_where(job):
    port = free_port()
    r = job.run("--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "lonely", "--rdzv-conf", "join_timeout=1", worker("env_dump.py"))
    assert r.rc == 1
    assert (f"rendezvous timed out after 1 s: 1 of 2-3 expected nodes joined round 0 at 127.0.0.1:{port} "
            f"(run id 'lonely')") in r.err, r.err
