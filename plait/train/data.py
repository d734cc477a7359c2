"""The trainer's token batches: one global sample stream, dealt out to the data-parallel ranks.

    TokenWindows (train split) -> plait.data.StatefulDistributedSampler (base = randperm(n,
    seed + epoch); rank r of R draws rest[r::R] of rest = base[consumed:]) -> B/R indices per
    step on each rank, so consumed += B (the global batch) per step -> stacked windows

The state is the sampler's `(epoch, seed, consumed)`, counted in the global stream, so a run
resumed with another data-parallel degree R' deals the remaining samples R' ways: no sample
repeated, none skipped. The union of the ranks' batches of one step is
base[consumed : consumed + B], exactly the batch a one-process run of the same config takes,
which is what the parity tests compare. An epoch's remainder shorter than a global batch is
dropped (the next epoch starts with a new permutation).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from plait.data import StatefulDistributedSampler
from plait.data.text import TokenWindows


class BatchStream:
    def __init__(self, dataset: TokenWindows, *, global_batch: int, dp_rank: int, dp_size: int,
                 seed: int) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp({dp_size})")
        if len(dataset) < global_batch:
            raise ValueError(f"the train split has {len(dataset)} windows, fewer than one global batch "
                             f"({global_batch}); use more data or a smaller batch_size")
        self.dataset, self.global_batch = dataset, global_batch
        self.sampler = StatefulDistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True,
                                                  seed=seed, drop_last=True)
        self._it: Iterator[int] | None = None

    def next_indices(self) -> torch.Tensor:
        """This rank's sample indices of the next step: (global_batch / dp,)."""
        state = self.sampler.state_dict()
        if state["consumed"] + self.global_batch > len(self.dataset):
            self.sampler.set_epoch(state["epoch"] + 1)
            self._it = None
        if self._it is None:
            self._it = iter(self.sampler)
        return torch.tensor([next(self._it) for _ in range(self.global_batch // self.sampler.num_replicas)])

    def __next__(self) -> torch.Tensor:
        """(global_batch / dp, seq_len + 1) int64 token windows."""
        return torch.stack([self.dataset[int(i)] for i in self.next_indices()])

    def __iter__(self) -> BatchStream:
        return self

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = None


def val_batches(dataset: TokenWindows, *, global_batch: int, count: int, dp_rank: int,
                dp_size: int) -> list[torch.Tensor]:
    """The first `count` global batches of the held-out split (fixed: comparable across steps),
    this rank's slice of each (the same dealing as training)."""
    n = min(count, len(dataset) // global_batch)
    if n == 0:
        raise ValueError(f"the held-out split has {len(dataset)} windows, fewer than one global batch "
                         f"({global_batch}); raise data.val_fraction or use more data")
    out = []
    for b in range(n):
        idx = torch.arange(b * global_batch, (b + 1) * global_batch)[dp_rank::dp_size]
        out.append(torch.stack([dataset[int(i)] for i in idx]))
    return out
