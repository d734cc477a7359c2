"""init_process_group from the launcher's environment (env:// rendezvous), in real processes."""

import os
import socket
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from plait import comm
    g = comm.init_process_group()          # everything from the environment
    t = torch.tensor([float(comm.get_rank(g) + 1)])
    comm.all_reduce(t, group=g)
    print(f"rank {comm.get_rank(g)} backend {comm.group_info(g).backend} sum {t.item():.0f}")
    comm.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_start_from_rank_world_size_and_master_env():
    procs, outs = _run_pair()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 0 backend gloo sum 3" in outs[0] and "rank 1 backend gloo sum 3" in outs[1]


def _run_pair():
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            p.kill()
    return procs, outs
