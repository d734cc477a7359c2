"""The FSDP1 tutorial (tests/fsdp1/tutorial.py) runs on plait with only its imports
changed, and gives torch's FullyShardedDataParallel's numbers: the same losses per epoch
and the same saved FULL_STATE_DICT (keys and values). Tolerance rtol 1e-5 / atol 1e-6:
both reduce the same gradients over the same ranks, in sums of a different shape
(torch's flat parameter vs plait's per-parameter padded shards), float32; a missing or
doubled shard would move the first epoch's loss at the 1e-2 level."""

import sys
import types
from pathlib import Path

import torch

from plait.testing import distributed
from tests.fsdp1 import tutorial


def _torch_port() -> types.ModuleType:
    source = Path(tutorial.__file__).read_text()
    assert tutorial.PLAIT_IMPORTS in source
    module = types.ModuleType("tutorial_torch")
    sys.modules["tutorial_torch"] = module
    exec(compile(source.replace(tutorial.PLAIT_IMPORTS, tutorial.TORCH_IMPORTS, 1), "tutorial_torch", "exec"),
         module.__dict__)
    return module


@distributed([2])
def test_tutorial_matches_torch(world_size):
    rank = torch.distributed.get_rank()
    ours, our_state = tutorial.fsdp_main(rank, world_size)
    theirs, their_state = _torch_port().fsdp_main(rank, world_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert list(our_state) == list(their_state)
    for k, v in their_state.items():
        torch.testing.assert_close(our_state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert (our_state == {}) == (rank != 0)
