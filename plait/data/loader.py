"""StatefulDataLoader: torch's DataLoader whose `state_dict()` is the sampler's state as of the
last batch it delivered, not as of the last index its workers prefetched.

Invariant: a DataLoader draws index batches in the main process, in order, up to
`num_workers * prefetch_factor` ahead of what `__next__` has returned; with `in_order=True` it
delivers batches in the order it drew them. So: the index sampler is wrapped to push the sampler's
`state_dict()` onto a FIFO as each batch is drawn, and delivering a batch pops its snapshot.

    sampler --draw batch k--> snapshot_k -> FIFO      DataLoader.__next__ -> batch k -> pop -> state

A resumed loader loads that state into its sampler and draws from there. The sampler must be
`Stateful` (`plait.data.StatefulDistributedSampler`, or anything with `state_dict`/
`load_state_dict` whose state after a draw says where the next draw starts).

torchdata's `StatefulDataLoader` (0.11) does the same snapshotting and works with
StatefulDistributedSampler on torch 2.13 (tested in tests/data when torchdata is installed).
plait does not depend on it: it reimplements DataLoader's private iterator classes (so it is tied
to torch internals), depends on requests/urllib3 for its other modules, and its own
`StatefulDistributedSampler` counts per rank, so it cannot resume with another data-parallel
degree. This class is a thin subclass instead, using only DataLoader's `_index_sampler` property.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader


class _Snapshotting:
    """An index sampler that records `state_source.state_dict()` after each item it yields."""

    def __init__(self, inner: Any, state_source: Any, fifo: deque) -> None:
        self.inner, self.state_source, self.fifo = inner, state_source, fifo

    def __iter__(self) -> Iterator[Any]:
        for item in self.inner:
            self.fifo.append(self.state_source.state_dict())
            yield item

    def __len__(self) -> int:
        return len(self.inner)


class _Delivering:
    """The DataLoader's iterator, noting the snapshot of each batch as it is delivered."""

    def __init__(self, loader: StatefulDataLoader, it: Iterator[Any]) -> None:
        self.loader, self.it = loader, it

    def __iter__(self) -> _Delivering:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.it)
        except StopIteration:
            self.loader._delivered = None  # the pass is over: the sampler's own state is exact
            raise
        self.loader._delivered = self.loader._fifo.popleft()
        return batch

    def __len__(self) -> int:
        return len(self.it)  # type: ignore[arg-type]


class StatefulDataLoader(DataLoader):
    """`torch.utils.data.DataLoader` (same arguments) with `state_dict()`/`load_state_dict()`.

    The state is `{"sampler": <the sampler's state after the last delivered batch>}`; with a
    StatefulDistributedSampler it is global, so a loader with another number of replicas resumes
    the same sample stream. Map-style datasets only (an IterableDataset has no sampler to resume).

    As torch's, creating an iterator draws its base seed from `generator`, or from torch's global
    generator when none is given; a job that restores plait.data.RNGState and then creates its
    iterator has drawn once more than the uninterrupted one, so pass `generator=` for a bitwise
    resume of the global random stream.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not getattr(self, "in_order", True):
            raise ValueError("StatefulDataLoader needs in_order=True: its state is the sampler's "
                             "state at the last batch delivered, so batches must come in draw order")
        self._fifo: deque = deque()
        self._delivered: dict[str, Any] | None = None
        self._wrapped: _Snapshotting | None = None

    @property
    def _state_source(self) -> Any:
        if self.batch_sampler is not None and hasattr(self.batch_sampler, "sampler"):
            return self.batch_sampler.sampler
        return self.sampler

    @property
    def _index_sampler(self) -> Any:
        source = self._state_source
        if not (hasattr(source, "state_dict") and hasattr(source, "load_state_dict")):
            return super()._index_sampler  # nothing to snapshot; state_dict() will say so
        if self._wrapped is None:  # one object: a persistent-workers iterator keeps it
            self._wrapped = _Snapshotting(super()._index_sampler, source, self._fifo)
        return self._wrapped

    def __iter__(self) -> _Delivering:  # type: ignore[override]
        self._fifo.clear()  # batches drawn but never delivered by an abandoned pass
        self._delivered = None
        return _Delivering(self, super().__iter__())

    def state_dict(self) -> dict[str, Any]:
        source = self._state_source
        if not hasattr(source, "state_dict"):
            raise TypeError(f"StatefulDataLoader: its sampler {type(source).__name__} has no "
                            "state_dict(); pass sampler=plait.data.StatefulDistributedSampler(...)")
        state = self._delivered if self._delivered is not None else source.state_dict()
        return {"sampler": dict(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "sampler" not in state_dict:
            raise ValueError(f"StatefulDataLoader state has no 'sampler' entry: keys {sorted(state_dict)}")
        source = self._state_source
        if not hasattr(source, "load_state_dict"):
            raise TypeError(f"StatefulDataLoader: its sampler {type(source).__name__} has no "
                            "load_state_dict(); pass sampler=plait.data.StatefulDistributedSampler(...)")
        source.load_state_dict(state_dict["sampler"])
        self._fifo.clear()
        self._delivered = None
