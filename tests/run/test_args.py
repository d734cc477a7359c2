"""Parsing `plait run`'s flags: torchrun's spellings and defaults, and a clear error for each mistake."""

from __future__ import annotations

import pytest

from plait.run.args import parse_config
from plait.run.config import LaunchError, Std, parse_nnodes, parse_rdzv_conf, parse_std
from plait.run.net import parse_endpoint
from tests.run.conftest import worker

SCRIPT = worker("env_dump.py")


@pytest.fixture(autouse=True)
def _no_pet_env(monkeypatch):
    import os

    for k in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(k)


def test_both_spellings_of_every_flag():
    dashed = parse_config(["--nnodes", "2:3", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", "h:1234", "--rdzv-id", "j", "--max-restarts", "3",
                           "--monitor-interval", "0.5", "--local-ranks-filter", "0", SCRIPT])
    underscored = parse_config(["--nnodes=2:3", "--nproc_per_node=4", "--rdzv_backend=c10d",
                                "--rdzv_endpoint=h:1234", "--rdzv_id=j", "--max_restarts=3",
                                "--monitor_interval=0.5", "--local_ranks_filter=0", SCRIPT])
    assert dashed == underscored
    assert (dashed.rdzv.min_nodes, dashed.rdzv.max_nodes, dashed.nproc_per_node) == (2, 3, 4)
    assert (dashed.rdzv.host, dashed.rdzv.port, dashed.rdzv.run_id, dashed.max_restarts) == ("h", 1234, "j", 3)


def test_torchrun_defaults():
    cfg = parse_config([SCRIPT, "--flag-for-the-script"])
    assert (cfg.rdzv.backend, cfg.rdzv.min_nodes, cfg.rdzv.max_nodes, cfg.nproc_per_node) == ("static", 1, 1, 1)
    assert (cfg.max_restarts, cfg.monitor_interval, cfg.shutdown_timeout, cfg.role) == (0, 0.1, 30.0, "default")
    assert cfg.command[-2:] == (SCRIPT, "--flag-for-the-script")
    assert cfg.rdzv.join_timeout == 600 and cfg.rdzv.last_call_timeout == 30


def test_pet_environment_variables_are_defaults(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    assert parse_config([SCRIPT]).nproc_per_node == 3
    assert parse_config(["--nproc-per-node", "5", SCRIPT]).nproc_per_node == 5  # the flag wins
    assert parse_config([SCRIPT]).max_restarts == 2


def test_standalone_rendezvouses_locally_on_a_free_port():
    cfg = parse_config(["--standalone", "--nproc-per-node", "cpu", SCRIPT])
    assert cfg.rdzv.backend == "c10d" and cfg.rdzv.single_node and cfg.master_port is None
    assert cfg.nproc_per_node >= 1 and cfg.rdzv.run_id != "none"


def test_rdzv_conf():
    conf, is_host = parse_rdzv_conf("join_timeout=5,last_call_timeout=0.5,read_timeout=7,is_host=1,use_libuv=1")
    assert (conf["join_timeout"], conf["last_call_timeout"], conf["timeout"], is_host) == (5, 0.5, 7, True)


def test_std_specs():
    assert parse_std("--tee", "3").for_rank(7) == Std.ALL
    spec = parse_std("--redirects", "0:1,1:2")
    assert (spec.for_rank(0), spec.for_rank(1), spec.for_rank(2)) == (Std.OUT, Std.ERR, Std.NONE)


@pytest.mark.parametrize("text, expected", [
    ("node0:29400", ("node0", 29400)), ("node0", ("node0", 99)), ("[::1]:5", ("::1", 5)), ("10.0.0.1:0", ("10.0.0.1", 0)),
])
def test_endpoints(text, expected):
    assert parse_endpoint(text, default_port=99, flag="--rdzv-endpoint") == expected


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0: a node needs at least 1 worker"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many': expected a positive integer"),
    (["--nnodes", "2:1"], "--nnodes 2:1: the minimum (2) is larger than the maximum (1)"),
    (["--nnodes", "0"], "--nnodes 0: the minimum number of nodes (0) must be at least 1"),
    (["--nnodes", "two"], "--nnodes 'two': expected a node count N or a range MIN:MAX"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:port"],
     "--rdzv-endpoint 'host:port': port 'port' is not a number from 0 to 65535"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:70000"], "port '70000' is not a number"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", ":"], "expected HOST:PORT"),
    (["--nnodes", "2", "--rdzv-backend", "c10d"], "needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0"], "port 0: the other nodes need a fixed port"),
    (["--nnodes", "1:2"], "static rendezvous needs a fixed node count"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2: must be in [0, 2)"),
    (["--standalone", "--nnodes", "2"], "--standalone runs one node, but --nnodes is 2"),
    (["--rdzv-backend", "etcd"], "not supported; use c10d"),
    (["--rdzv-conf", "join_timout=5"], "unknown key 'join_timout'"),
    (["--rdzv-conf", "join_timeout=soon"], "expected a number of seconds"),
    (["--redirects", "9"], "--redirects '9'"),
    (["--local-ranks-filter", "a"], "--local-ranks-filter 'a'"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
    (["-m", "--no-python"], "cannot be used together"),
    (["--numa-binding", "node"], "--numa-binding is a torchrun extension"),
    (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
])
def test_bad_input_names_the_flag_and_value(argv, message):
    with pytest.raises(LaunchError) as e:
        parse_config([*argv, SCRIPT])
    assert message in str(e.value)


def test_missing_script():
    with pytest.raises(LaunchError, match=r"script 'no_such_script.py' not found \(cwd "):
        parse_config(["no_such_script.py"])
    with pytest.raises(LaunchError, match="--no-python 'no-such-program-xyz': no such executable"):
        parse_config(["--no-python", "no-such-program-xyz"])


def test_nnodes_forms():
    assert parse_nnodes("4") == (4, 4) and parse_nnodes("2:4") == (2, 4)
