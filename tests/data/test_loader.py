"""StatefulDataLoader resumes where the last *delivered* batch left off, with workers prefetching
ahead, and with another number of replicas: the union of what every rank's loader delivered before
and after equals one pass over the global stream. torchdata's StatefulDataLoader, where installed,
does the same with plait's sampler."""

import pytest
import torch
from torch.utils.data import DataLoader

from plait.data import RNGState, StatefulDataLoader, StatefulDistributedSampler

N, B = 37, 2  # 37 samples: uneven for 2 and 3 replicas


def loaders(cls, replicas, **kw):
    return [cls(range(N), batch_size=B, sampler=StatefulDistributedSampler(range(N), num_replicas=replicas,
                                                                          rank=r, seed=3, drop_last=True),
                **kw) for r in range(replicas)]


def run(cls, before, after, steps, **kw):
    """`steps` batches on `before` replicas, save, resume on `after`; the global order seen."""
    first = loaders(cls, before, **kw)
    its = [iter(dl) for dl in first]
    seen = [[next(it).tolist() for _ in range(steps)] for it in its]
    states = [dl.state_dict() for dl in first]
    if cls is StatefulDataLoader:  # torchdata's state also holds per-rank worker bookkeeping
        assert all(st == states[0] for st in states)
    del its
    second = loaders(cls, after, **kw)
    for dl in second:
        dl.load_state_dict(states[0])
    rest = [[b.tolist() for b in dl] for dl in second]
    return interleave(seen) + interleave(rest), states[0]


def interleave(batches_per_rank):
    """Rank r's k-th sample is the global stream's (k * replicas + r)-th: undo the dealing."""
    flat = [[x for b in batches for x in b] for batches in batches_per_rank]
    return [f[k] for k in range(len(flat[0])) for f in flat]


def stream(replicas_after, consumed):
    g = torch.Generator()
    g.manual_seed(3)
    base = torch.randperm(N, generator=g).tolist()
    rest = base[consumed:]
    return base[:consumed] + rest[: len(rest) // replicas_after * replicas_after]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("before,after", [(2, 3), (3, 1)])
def test_resume_counts_delivered_batches_not_prefetched(workers, before, after):
    kw = dict(num_workers=workers, prefetch_factor=3 if workers else None)
    order, state = run(StatefulDataLoader, before, after, steps=3, **kw)
    assert state["sampler"]["consumed"] == before * 3 * B  # prefetched batches are not counted
    assert order == stream(after, before * 3 * B)
    assert len(order) == len(set(order))  # nothing twice


def test_plain_dataloader_sampler_state_runs_ahead():
    """Why the loader wraps: with workers, the sampler's own count includes prefetched indices."""
    dl = DataLoader(range(N), batch_size=B, num_workers=2, prefetch_factor=3,
                    sampler=StatefulDistributedSampler(range(N), num_replicas=1, rank=0))
    it = iter(dl)
    next(it)
    assert dl.sampler.state_dict()["consumed"] > B
    del it


def test_persistent_workers_and_epochs():
    sampler = StatefulDistributedSampler(range(N), num_replicas=2, rank=1, seed=3)
    dl = StatefulDataLoader(range(N), batch_size=B, sampler=sampler, num_workers=1, persistent_workers=True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        it = iter(dl)
        next(it)
        assert dl.state_dict()["sampler"] == {"epoch": epoch, "seed": 3, "consumed": 2 * B, "num_samples_total": N}
        list(it)
        assert dl.state_dict()["sampler"]["consumed"] == N


def test_loader_without_stateful_sampler_says_what_to_pass():
    dl = StatefulDataLoader(range(N), batch_size=B)
    with pytest.raises(TypeError, match="SequentialSampler has no state_dict"):
        dl.state_dict()


def test_torchdata_stateful_dataloader_with_plait_sampler():
    td = pytest.importorskip("torchdata.stateful_dataloader")
    for workers in (0, 2):
        kw = dict(num_workers=workers, prefetch_factor=3 if workers else None)
        order, state = run(td.StatefulDataLoader, 2, 3, steps=3, **kw)
        assert order == stream(3, 2 * 3 * B)


def test_rng_state_round_trip():
    import random

    import numpy as np

    rng = RNGState()
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.rand(3), random.random(), np.random.rand(2), random.gauss(0, 1)
    saved = rng.state_dict()
    expect = (torch.rand(4), random.random(), random.gauss(0, 1), np.random.rand(3), np.random.randn(1))
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    rng.load_state_dict(saved)
    got = (torch.rand(4), random.random(), random.gauss(0, 1), np.random.rand(3), np.random.randn(1))
    torch.testing.assert_close(got[0], expect[0], atol=0, rtol=0)
    assert got[1:3] == expect[1:3]
    np.testing.assert_array_equal(got[3], expect[3]), np.testing.assert_array_equal(got[4], expect[4])
    assert all(isinstance(v, (torch.Tensor, int, float, str, type(None))) for v in saved.values())
    with pytest.raises(ValueError, match=r"missing \['python'"):
        rng.load_state_dict({"torch": saved["torch"]})
