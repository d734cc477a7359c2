"""init_process_group from the launcher's environment (env:// rendezvous), in real processes.

The two processes are test_exit's (`plait_pair`): its script forms the group from RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT alone and all-reduces before its exit-time check, so
one start (two torch imports) serves both files.
"""

from tests.comm.test_exit import plait_pair


def test_two_processes_start_from_rank_world_size_and_master_env():
    results = plait_pair()
    assert [rc for rc, _ in results] == [0, 0], results
    outs = [out for _, out in results]
    assert "rank 0 backend gloo sum 3" in outs[0] and "rank 1 backend gloo sum 3" in outs[1]
