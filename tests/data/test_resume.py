"""Data state through plait.checkpoint: a job on 2 data-parallel ranks saves its loader and RNG
state mid-epoch; resumed on 3 ranks (and on 1) the loaders deliver exactly the rest of the global
sample stream (the union over ranks of before + after is every sample once, in stream order);
resumed on 2 ranks, each rank's next random draws (torch, Python, numpy) and batches equal the
uninterrupted run's, bitwise."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import plait.checkpoint as dcp
from plait.data import RNGState, StatefulDataLoader, StatefulDistributedSampler
from plait.testing import run_distributed
from tests.checkpoint._layouts import world

N, B, SEED = 41, 3, 11  # 41 samples: uneven for 2 and 3 ranks; drop_last so no padding repeats


def loader(replicas: int, rank: int) -> StatefulDataLoader:
    sampler = StatefulDistributedSampler(range(N), num_replicas=replicas, rank=rank, seed=SEED, drop_last=True)
    sampler.set_epoch(1)
    # num_workers=0: pool ranks are daemon processes (no children); prefetching is test_loader.py's
    # its own generator: a DataLoader iterator draws its base seed from torch's global generator
    # otherwise, and the resumed job creates its iterator after the RNG state is restored
    return StatefulDataLoader(range(N), batch_size=B, sampler=sampler, generator=torch.Generator().manual_seed(0))


def draws() -> list[float]:
    return [float(torch.rand(())), random.random(), float(np.random.rand())]


def save_mid_epoch(path: str):
    rank, n = world()
    torch.manual_seed(rank), random.seed(10 + rank), np.random.seed(20 + rank)  # per-rank streams
    dl = loader(n, rank)
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(2)]
    draws()
    dcp.save({"loader": dl, f"rng.{rank}": RNGState()}, checkpoint_id=path)
    return seen, [b.tolist() for b in it], draws()


def resume(path: str):
    rank, n = world()
    dl = loader(n, rank)
    state = {"loader": dl, f"rng.{rank}": RNGState()}
    # rng.{r} of other ranks are in the checkpoint, not in this rank's state: a partial load
    dcp.load(state if n == 2 else {"loader": dl}, checkpoint_id=path,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return [b.tolist() for b in dl], draws() if n == 2 else None


def order(batches_per_rank):
    flat = [[x for b in batches for x in b] for batches in batches_per_rank]
    return [f[k] for k in range(min(map(len, flat))) for f in flat]


@pytest.mark.parametrize("resume_world", [3, 2, 1])
def test_loader_and_rng_resume_across_dp_degree(tmp_path, resume_world):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(save_mid_epoch, path, world_size=2)
    before = order([s[0] for s in saved])
    resumed = run_distributed(resume, path, world_size=resume_world) if resume_world > 1 else [resume(path)]
    after = order([r[0] for r in resumed])
    g = torch.Generator().manual_seed(SEED + 1)
    stream = torch.randperm(N, generator=g).tolist()
    assert before == stream[:len(before)] and len(before) == 2 * 2 * B
    rest = len(stream) - len(before)
    assert after == stream[len(before):len(before) + rest // resume_world * resume_world]  # drop_last's tail
    assert len(set(before + after)) == len(before + after)  # nothing seen twice
    if resume_world == 2:
        for (_, rest_batches, expect_draws), (got_batches, got_draws) in zip(saved, resumed):
            assert got_batches == rest_batches and got_draws == expect_draws
