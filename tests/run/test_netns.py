"""Two nodes as two hosts: network namespaces joined by a veth pair, made and removed by the test.

Runs where the test can create namespaces (root, `ip`); elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from tests.run.conftest import worker


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@pytest.fixture
def two_hosts():
    """Namespaces A (10.213.N.1) and B (10.213.N.2), linked by veth `pt0`; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = f"plait{os.getpid()}x{random.randrange(1 << 16)}"
    names = [f"{tag}a", f"{tag}b"]
    subnet = f"10.213.{random.randrange(256)}"
    try:
        for ns in names:
            _ip("netns", "add", ns)
        _ip("link", "add", "pt0", "netns", names[0], "type", "veth", "peer", "name", "pt0", "netns", names[1])
        for i, ns in enumerate(names):
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "pt0")
            _ip("-n", ns, "link", "set", "pt0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns in names:
            _ip("netns", "del", ns, check=False)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    yield names, [f"{subnet}.1", f"{subnet}.2"]
    for ns in names:
        _ip("netns", "del", ns, check=False)
    left = _ip("netns", "list").stdout
    assert not any(ns in left for ns in names), f"namespaces left behind: {left}"


def test_two_hosts_rendezvous_over_tcp_and_all_reduce_over_gloo(job, two_hosts):
    (ns_a, ns_b), (addr_a, addr_b) = two_hosts
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{addr_a}:29400", "--rdzv-conf", "join_timeout=120", worker("gloo_allreduce.py")]
    env = {"GLOO_SOCKET_IFNAME": "pt0"}  # the hostname resolves to loopback, which is per namespace
    a = job.start(*args, env=env, wrap=["ip", "netns", "exec", ns_a])
    b = job.start(*args, env=env, wrap=["ip", "netns", "exec", ns_b])
    ra, rb = a.wait(), b.wait()
    assert ra.rc == 0 and rb.rc == 0, ra.err + rb.err
    assert "serving the rendezvous store" in ra.err and "serving" not in rb.err
    results = [job.read(n) for n in job.outputs("allreduce_a0_")]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    envs = {n: job.read(n) for n in job.outputs("allreduce_")}
    assert len(envs) == 2
