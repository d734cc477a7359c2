"""tensor._random: torch's manual_seed(seed, mesh) and OffsetBasedRNGTracker seed plait's DTensor
random ops (torchtitan's set_determinism calls manual_seed on its SPMD mesh).

plait's random ops draw the whole tensor from the default generator and keep each rank's
piece; the first op on a mesh broadcasts coordinate 0's state. After manual_seed the draw
is the single-process draw after torch.manual_seed(seed), with no broadcast (torch's
run_state_sync=False: a rank's seed is its own, as for a pipeline stage's). torch's own
manual_seed warns and seeds nothing on a CPU mesh, so the reference here is the
single-process draw, not torch's DTensor.
"""

import torch

from plait import comm
from plait.device_mesh import init_device_mesh
from plait.tensor import Replicate, Shard, _random, distribute_tensor
from plait.testing import distributed


def _diverge() -> None:
    torch.rand(comm.global_rank() + 1)  # each rank's default generator now differs


@distributed([2])
def test_manual_seed_gives_the_single_process_draw():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("seeded",))
    _diverge()
    _random.manual_seed(7, mesh)
    x = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]).uniform_()
    torch.manual_seed(7)
    torch.testing.assert_close(x.full_tensor(), torch.zeros(5, 3).uniform_(), rtol=0, atol=0)
    assert _random.is_rng_supported_mesh(mesh) and isinstance(_random._rng_tracker, _random.OffsetBasedRNGTracker)


@distributed([2])
def test_manual_seed_does_not_broadcast_but_the_tracker_does():
    rank = comm.global_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("stage_seeded",))
    _random.manual_seed(100 + rank, mesh)  # torch does not check; each rank keeps its seed
    mine = distribute_tensor(torch.zeros(4), mesh, [Replicate()]).uniform_().to_local()
    torch.manual_seed(100 + rank)
    torch.testing.assert_close(mine, torch.zeros(4).uniform_(), rtol=0, atol=0)
    _diverge()
    _random.OffsetBasedRNGTracker(mesh)  # run_state_sync=True: coordinate 0's state, now
    states = [torch.empty_like(torch.get_rng_state()) for _ in range(2)]
    torch.distributed.all_gather(states, torch.get_rng_state())
    assert torch.equal(states[0], states[1]), "every rank holds coordinate 0's state"
