"""StatefulDistributedSampler: torch's DistributedSampler order from a fresh state, and a global
state that resumes the same global stream with any number of replicas (checked on the union of
what every rank sees: nothing twice, nothing skipped). Pure logic: ranks are objects, no processes."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from plait import comm
from plait.data import StatefulDistributedSampler
from plait.testing import distributed

N = 23  # not divisible by 2, 3 or 4


def samplers(n_replicas, **kw):
    return [StatefulDistributedSampler(range(N), num_replicas=n_replicas, rank=r, **kw) for r in range(n_replicas)]


def draw(ss, k):
    """Each rank draws k indices (or all it has); returns the global order they form."""
    its = [iter(s) for s in ss]
    per_rank = [[next(it) for _ in range(k)] for it in its]
    return [per_rank[r][i] for i in range(k) for r in range(len(ss))], its


def base(epoch, seed=0, shuffle=True):
    if not shuffle:
        return list(range(N))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(N, generator=g).tolist()


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_fresh_order_is_torchs(replicas, shuffle, drop_last):
    for epoch in (0, 3):
        for r in range(replicas):
            ours = StatefulDistributedSampler(range(N), num_replicas=replicas, rank=r, shuffle=shuffle,
                                              seed=7, drop_last=drop_last)
            ref = DistributedSampler(range(N), num_replicas=replicas, rank=r, shuffle=shuffle, seed=7,
                                     drop_last=drop_last)
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref)
            assert (ours.num_samples, ours.total_size) == (ref.num_samples, ref.total_size)


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2), (4, 1), (1, 4), (2, 2)])
def test_resume_with_another_degree_continues_the_global_stream(before, after):
    epoch, steps = 2, 3
    first = samplers(before, seed=5)
    for s in first:
        s.set_epoch(epoch)
    seen, _ = draw(first, steps)
    states = [s.state_dict() for s in first]
    assert all(st == states[0] for st in states), "the state is global: every rank reports the same"
    assert states[0] == {"epoch": epoch, "seed": 5, "consumed": before * steps, "num_samples_total": N}

    second = samplers(after, seed=5)
    for s in second:
        s.load_state_dict(states[0])
        s.set_epoch(epoch)  # the loop's usual call on resuming: keeps the loaded position
    rest = [list(s) for s in second]
    k = len(rest[0])
    assert all(len(x) == k for x in rest)
    following = [rest[r][i] for i in range(k) for r in range(after)]
    remaining = N - before * steps
    stream = base(epoch, seed=5)
    assert seen + following[:remaining] == stream  # the uninterrupted global stream, in order
    assert sorted(seen + following[:remaining]) == list(range(N))  # so: nothing twice or skipped
    # torch's padding: the last round repeats the head of what was left, to even the ranks out
    assert following[remaining:] == stream[before * steps:][: len(following) - remaining]
    assert second[0].state_dict()["consumed"] == N

    # the next pass of the same epoch is a full one again, and a new epoch starts fresh
    assert list(second[0]) == _torch_epoch(after, 0, epoch)
    second[0].set_epoch(epoch + 1)
    assert second[0].state_dict()["consumed"] == 0 and list(second[0]) == _torch_epoch(after, 0, epoch + 1)


def _torch_epoch(replicas, rank, epoch):
    ref = DistributedSampler(range(N), num_replicas=replicas, rank=rank, seed=5)
    ref.set_epoch(epoch)
    return list(ref)


def test_resume_with_drop_last_skips_only_the_tail_torch_drops():
    first = samplers(3, drop_last=True, shuffle=False)
    seen, _ = draw(first, 2)  # 6 of 23
    second = samplers(2, drop_last=True, shuffle=False)
    for s in second:
        s.load_state_dict(first[0].state_dict())
    assert len(second[0]) == 8  # 17 left: floor(17 / 2)
    rest = [list(s) for s in second]
    following = [rest[r][i] for i in range(len(rest[0])) for r in range(2)]
    assert seen + following == list(range(22))  # 16 dealt two ways, the last one dropped


def test_length_reports_the_resumed_pass():
    first = samplers(2)
    draw(first, 4)
    s = StatefulDistributedSampler(range(N), num_replicas=3, rank=2)
    s.load_state_dict(first[0].state_dict())
    assert len(s) == 5  # ceil((23 - 8) / 3)
    assert len(list(s)) == 5 and len(s) == 8  # the next pass is a full one: ceil(23 / 3)


def test_bad_state_is_an_error_naming_the_values():
    s = StatefulDistributedSampler(range(N), num_replicas=2, rank=0, seed=1)
    with pytest.raises(ValueError, match=r"seed 2, this sampler seed 1"):
        s.load_state_dict({"epoch": 0, "seed": 2, "consumed": 0})
    with pytest.raises(ValueError, match=r"dataset of 30 samples; this one has 23"):
        s.load_state_dict({"epoch": 0, "seed": 1, "consumed": 0, "num_samples_total": 30})
    with pytest.raises(ValueError, match=r"consumed\(40\) is not in \[0, 23\]"):
        s.load_state_dict({"epoch": 0, "seed": 1, "consumed": 40})
    with pytest.raises(ValueError, match=r"missing \['consumed'\]"):
        s.load_state_dict({"epoch": 0, "seed": 1})
    with pytest.raises(ValueError, match=r"Invalid rank 2"):
        StatefulDistributedSampler(range(N), num_replicas=2, rank=2)


@distributed(world_sizes=[2])
def test_replicas_and_rank_default_to_the_world():
    g = comm.world_group()
    s = StatefulDistributedSampler(range(N))
    assert (s.num_replicas, s.rank) == (2, comm.get_rank(g))
    assert list(s) == list(DistributedSampler(range(N), num_replicas=2, rank=comm.get_rank(g)))
