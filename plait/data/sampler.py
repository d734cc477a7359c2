"""StatefulDistributedSampler: torch's DistributedSampler whose position is global, so it resumes
with any data-parallel degree.

Invariant: every epoch is one global stream `base = randperm(n, seed + epoch)` (or `range(n)`),
and a pass over it by R replicas hands rank r the elements `rest[r::R]` of `rest = base[consumed:]`
(padded by repetition to a multiple of R, or truncated with drop_last: torch's rule). The state is
`(epoch, seed, consumed)`, counted in `base`, not per rank: `consumed = start + k * R` after each
rank drew k indices, since data-parallel ranks step in lockstep. Resumed with R' replicas, the
remaining `base[consumed:]` is dealt out R' ways, so the union over ranks continues the same global
stream: no sample seen twice or skipped (except torch's end-of-epoch padding, which repeats samples
to even the ranks out). With `consumed == 0` the order is exactly torch's DistributedSampler.

Data flow:  load_state_dict -> pending start -> __iter__ deals base[start:] -> live `consumed` per
index drawn -> state_dict. A DataLoader draws indices ahead of what it has delivered (workers,
prefetch_factor); `plait.data.StatefulDataLoader` (or torchdata's) records the sampler's state per
batch as drawn and reports the one of the last batch delivered, so what was prefetched is not
counted as seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from plait import comm


class StatefulDistributedSampler(Sampler[int]):
    """torch.utils.data.DistributedSampler's constructor and order, plus a global, resumable state.

    `state_dict()` -> `{"epoch", "seed", "consumed", "num_samples_total"}`; `load_state_dict`
    makes the next pass start where the saved one stopped (any number of replicas), after which
    passes start at 0 again. `set_epoch(e)` with another epoch than the current one starts a fresh
    epoch; with the same epoch (the usual call after resuming) it keeps the loaded position.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            if not comm.is_initialized():
                raise RuntimeError("StatefulDistributedSampler: pass num_replicas and rank, or call "
                                   "plait.comm.init_process_group first")
            group = comm.world_group()
            num_replicas = comm.get_world_size(group) if num_replicas is None else num_replicas
            rank = comm.get_rank(group) if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas({num_replicas}) must be at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._consumed = 0  # global samples of this epoch drawn so far (by all ranks together)
        self._start = 0  # where the next pass starts: the loaded position, once

    # torch's attributes, for the next pass
    @property
    def num_samples(self) -> int:
        return self._per_rank(len(self.dataset) - self._start)  # type: ignore[arg-type]

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def _per_rank(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def _base(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # torch's seeding, so consumed == 0 is its order
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        base = self._base()
        n = len(base)
        start, self._start = self._start, 0
        if start >= n:  # a finished epoch iterated again: a full pass, as torch's sampler gives
            start = 0
        rest = base[start:]
        per_rank = self._per_rank(len(rest))
        total = per_rank * self.num_replicas
        if total > len(rest):  # torch's padding: repeat the stream's head to even ranks out
            rest = (rest * math.ceil(total / len(rest)))[:total]
        mine = rest[self.rank:total:self.num_replicas]
        assert len(mine) == per_rank, (len(mine), per_rank)
        self._consumed = start
        return self._deal(mine, start, n)

    def _deal(self, mine: list[int], start: int, n: int) -> Iterator[int]:
        for k, index in enumerate(mine, start=1):
            # counted before the yield: a state taken once this index is out counts it
            self._consumed = min(start + k * self.num_replicas, n)
            yield index

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._consumed = self._start = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "consumed": self._consumed,
                "num_samples_total": len(self.dataset)}  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"epoch", "seed", "consumed"} - set(state_dict)
        if missing:
            raise ValueError(f"StatefulDistributedSampler state is missing {sorted(missing)}: got keys "
                             f"{sorted(state_dict)}")
        n = len(self.dataset)  # type: ignore[arg-type]
        saved_n = state_dict.get("num_samples_total", n)
        if saved_n != n:
            raise ValueError(f"StatefulDistributedSampler state was saved for a dataset of {saved_n} "
                             f"samples; this one has {n}: the stream would not continue")
        if state_dict["seed"] != self.seed:
            raise ValueError(f"StatefulDistributedSampler state has seed {state_dict['seed']}, this "
                             f"sampler seed {self.seed}: construct it with seed={state_dict['seed']}")
        consumed = int(state_dict["consumed"])
        if not 0 <= consumed <= n:
            raise ValueError(f"StatefulDistributedSampler state consumed({consumed}) is not in [0, {n}]")
        self.epoch = int(state_dict["epoch"])
        self._start = self._consumed = consumed
