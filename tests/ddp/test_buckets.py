"""Buckets: the assignment against torch's own, the rebuild in ready order, and overlap.

Pure assignment tests need no processes. The rebuild test runs torch's DDP beside
plait's on the same model and compares bucket membership after the first iteration. The
overlap test records, on one timeline, every all-reduce plait.comm issues and the moment
backward produces its last gradient.
"""

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from plait import comm
from plait.ddp import DistributedDataParallel
from plait.ddp.buckets import assign_buckets
from plait.ddp.replica import bucket_caps
from plait.testing import distributed
from tests.ddp.common import PER_RANK, world

MiB = 1024 * 1024


@pytest.mark.parametrize("seed", range(5))
def test_assignment_matches_torch_in_any_order(seed):
    rng = random.Random(seed)
    params = [torch.empty(rng.choice([1, 7, 300, 1000, 5000])) for _ in range(rng.randint(1, 30))]
    order = list(range(len(params)))
    rng.shuffle(order)
    caps = [rng.choice([400, 4000]), rng.choice([4000, 20000])]
    theirs, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], caps, [], order)
    assert assign_buckets(params, order, caps) == [list(b) for b in theirs]


def test_one_dtype_per_bucket_in_the_order_buckets_fill():
    params = [torch.empty(100), torch.empty(100, dtype=torch.float64), torch.empty(300), torch.empty(10)]
    # float32 closes at param 2 (1600 B >= 1000); float64 (800 B) is left open to the end
    assert assign_buckets(params, [0, 1, 2, 3], [1000]) == [[0, 2], [1], [3]]
    assert assign_buckets(params, [3, 2, 1, 0], [1000]) == [[3, 2], [1], [0]]
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(params, [0], [0])


def test_caps_follow_torch():
    assert bucket_caps(None, None) == [1 * MiB, 25 * MiB]  # default: a 1 MiB first bucket
    assert bucket_caps(25, None) == [25 * MiB]  # an explicit cap applies to every bucket
    assert bucket_caps(None, [1, 4]) == [1 * MiB, 4 * MiB]
    with pytest.raises(ValueError, match="positive"):
        bucket_caps(0, None)


class Scrambled(nn.Module):
    """Registered c, b, a; used a, b, c: registration order is not the ready order."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.c = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.a = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def bucket_names(buckets_params, model):
    names = {p: n for n, p in model.named_parameters()}
    return [[names[p] for p in params] for params in buckets_params]


@distributed([2])
@pytest.mark.parametrize("width, cap_mb", [(64, 0.02), (64, 0.05), (512, None)])
def test_rebuilt_buckets_match_torch(width, cap_mb):
    """After one iteration both rebuild in ready order (c, b, a) with the same caps; with the
    default caps (None) the first bucket holds ~1 MiB and the rest one 25 MiB bucket."""
    g, rank, n = world()
    torch.manual_seed(0)
    ours, theirs = Scrambled(width), Scrambled(width)
    theirs.load_state_dict(ours.state_dict())
    ddp, torch_ddp = DistributedDataParallel(ours, bucket_cap_mb=cap_mb), TorchDDP(theirs, bucket_cap_mb=cap_mb)
    assert bucket_names([b.params for b in ddp.reducer.buckets], ours)[0][:2] == ["a.bias", "a.weight"]
    for _ in range(2):  # the second forward rebuilds
        x = torch.randn(PER_RANK, width)
        ddp(x).sum().backward()
        torch_ddp(x).sum().backward()
    mine = bucket_names([b.params for b in ddp.reducer.buckets], ours)
    torch_buckets = torch_ddp.reducer._get_zeros_like_grad_buckets()
    expected = bucket_names([b.parameters() for b in torch_buckets], theirs)
    assert mine == expected
    assert mine[0][:2] == ["c.bias", "c.weight"]  # ready first: the layer used last


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        self.spare = nn.Linear(32, 32)  # never used; registered last, so first in reverse order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Timeline(comm.CommListener):
    def __init__(self, events: list) -> None:
        self.events = events

    def on_start(self, event) -> None:
        if event.op == "all_reduce":
            self.events.append("all_reduce")


@distributed([2])
@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_first_bucket_all_reduce_starts_before_the_last_gradient_exists(find_unused_parameters):
    """Overlap: with one bucket per layer, the bucket of the last layer (ready first) is
    on the wire while backward still computes the first layer's gradients. With
    find_unused_parameters the unused layer's bucket (first in line) goes out as soon as
    backward starts, found by walking the graph, instead of holding every bucket back."""
    events: list[str] = []
    model = Deep()
    if not find_unused_parameters:
        model.spare.requires_grad_(False)  # without the flag every trained parameter must be used
    # layer 0's weight gets its gradient last; this hook runs before DDP's own on it
    model.layers[0].weight.register_post_accumulate_grad_hook(lambda p: events.append("last gradient"))
    ddp = DistributedDataParallel(model, bucket_cap_mb=32 * 33 * 4 / MiB,  # one layer per bucket
                                  find_unused_parameters=find_unused_parameters)
    with comm.listening(Timeline(events)):
        for iteration in range(2):  # before and after the rebuild
            events.clear()
            ddp(torch.randn(PER_RANK, 32)).sum().backward()
            buckets = len(ddp.reducer.buckets)
            assert events.count("all_reduce") == buckets + find_unused_parameters, events  # + used map
            last = events.index("last gradient")
            assert events[:last].count("all_reduce") == buckets - 1, (iteration, events)  # all but layer 0's
