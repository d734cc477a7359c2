"""The trainer's token batches: one global sample stream, dealt out to the data-parallel ranks.

    TokenWindows (train split) -> per epoch base = randperm(n, seed + epoch)
    step: rest = base[consumed:], rank r of R takes rest[r::R][:B/R]; consumed += B (global B)

The state is `(epoch, consumed)`, counted in the global stream, so a run resumed with another
data-parallel degree R' deals the remaining samples R' ways: no sample repeated, none skipped.
This is the rule of `plait.data.StatefulDistributedSampler` (its `rest[r::R]`, drop_last);
the union of the ranks' batches of one step is base[consumed : consumed + B], exactly the
batch a one-process run of the same config takes, which is what parity tests compare.
An epoch's remainder shorter than a global batch is dropped.
"""

from __future__ import annotations

import torch

from plait.data.text import TokenWindows


class BatchStream:
    def __init__(self, dataset: TokenWindows, *, global_batch: int, dp_rank: int, dp_size: int,
                 seed: int) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp({dp_size})")
        if len(dataset) < global_batch:
            raise ValueError(f"the train split has {len(dataset)} windows, fewer than one global batch "
                             f"({global_batch}); use more data or a smaller batch_size")
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.consumed = 0, 0
        self._base: torch.Tensor | None = None

    def _order(self) -> torch.Tensor:
        if self._base is None:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._base = torch.randperm(len(self.dataset), generator=g)
        return self._base

    def next_indices(self) -> torch.Tensor:
        """This rank's sample indices of the next step: (global_batch / dp,)."""
        if self.consumed + self.global_batch > len(self.dataset):
            self.epoch, self.consumed, self._base = self.epoch + 1, 0, None
        rest = self._order()[self.consumed : self.consumed + self.global_batch]
        self.consumed += self.global_batch
        return rest[self.dp_rank :: self.dp_size]

    def __next__(self) -> torch.Tensor:
        """(global_batch / dp, seq_len + 1) int64 token windows."""
        return torch.stack([self.dataset[int(i)] for i in self.next_indices()])

    def __iter__(self) -> BatchStream:
        return self

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"the checkpoint's data stream was seeded {state['seed']}, this run {self.seed}")
        self.epoch, self.consumed, self._base = int(state["epoch"]), int(state["consumed"]), None


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
