"""Join: training on uneven inputs without a hang; torch's `Join`/`Joinable`/`JoinHook`.

    not yet joined, each iteration:  Joinable -> Join.notify_join_context(): all-reduce(1)
                                     then its own collectives (forward, backward)
    joined (out of inputs), in __exit__:
        loop: all-reduce(0) -> number of ranks still training
              == 0 -> everyone is done: post_hook(is_last_joiner) on each joinable, leave
              >  0 -> main_hook() on each joinable: the same collectives, zeros in

The invariant: a joined rank issues exactly the collectives a training rank issues in one
iteration, in the same order, so the group never waits on it. The first joinable issues
the notices; the others only shadow their own collectives.
"""

from __future__ import annotations

import abc
import warnings
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch.distributed import ProcessGroup

from plait import comm

UNEVEN_WARN_THRESHOLD = 1000  # iterations a joined rank shadows before it warns


class JoinHook:
    """What a joinable does for a joined rank: `main_hook` shadows one training iteration's
    collectives, `post_hook` runs once everyone has joined."""

    def main_hook(self) -> None:
        pass

    def post_hook(self, is_last_joiner: bool) -> None:
        pass


class _JoinConfig(NamedTuple):
    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def disabled() -> _JoinConfig:
        return _JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class Joinable(abc.ABC):
    """Something with per-iteration collectives that a joined rank must shadow."""

    @abc.abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = _JoinConfig.disabled()

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook: ...

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device: ...

    @property
    @abc.abstractmethod
    def join_process_group(self) -> ProcessGroup: ...


class Join:
    """Context manager: ranks that run out of inputs keep answering the others' collectives.

        with Join([model]):            # or `with model.join():`
            for batch in my_batches:   # a different number per rank
                model(batch).sum().backward(); opt.step()
    """

    def __init__(self, joinables: list, enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs: Any) -> None:
        if not joinables:
            raise ValueError("Join needs at least one joinable")
        self._joinables = list(joinables)
        self._hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._enable = enable
        self._throw = throw_on_early_termination
        for k, j in enumerate(self._joinables):
            j._join_config = _JoinConfig(enable, throw_on_early_termination, is_first_joinable=k == 0)
        groups = [j.join_process_group for j in self._joinables]
        if any(g is not groups[0] for g in groups):
            raise ValueError("every joinable in one Join must use the same process group")
        self._group = groups[0]
        self._device = self._joinables[0].join_device
        self._rank = comm.get_rank(self._group)

    def __enter__(self) -> Join:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._enable and exc_type is None:
                self._shadow_until_all_joined()
        finally:
            for j in self._joinables:
                j._join_config = _JoinConfig.disabled()

    def _shadow_until_all_joined(self) -> None:
        is_last_joiner = True
        shadowed = 0
        while True:
            count = torch.zeros(1, device=self._device)
            comm.all_reduce(count, group=self._group)  # answers each training rank's notice
            if count.item() == 0:
                break
            if self._throw:
                comm.all_reduce(torch.ones(1, device=self._device), group=self._group)
                raise RuntimeError(f"rank {self._rank} exhausted all inputs")
            for hook in self._hooks:
                hook.main_hook()
            is_last_joiner = False
            shadowed += 1
            if shadowed == UNEVEN_WARN_THRESHOLD + 1:
                warnings.warn(
                    f"rank {self._rank} has shadowed {shadowed} iterations of ranks with more "
                    "inputs; uneven inputs this skewed waste most of this rank's time",
                    stacklevel=3,
                )
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    @staticmethod
    def notify_join_context(joinable: Any) -> comm.Handle | None:
        """Tell the joined ranks this rank is still training (call before each iteration's
        collectives). Returns the notice's handle, whose result counts the training ranks,
        for the first joinable of an enabled Join; None otherwise. With
        throw_on_early_termination, raises once any rank has joined."""
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise TypeError(f"{type(joinable).__name__} did not call Joinable.__init__")
        if not (config.enable and config.is_first_joinable):
            return None
        device, group = joinable.join_device, joinable.join_process_group
        handle = comm.all_reduce(torch.ones(1, device=device), group=group, async_op=True)
        if config.throw_on_early_termination:
            joined = torch.zeros(1, device=device)
            comm.all_reduce(joined, group=group)
            if joined.item():
                raise RuntimeError("a rank exhausted its inputs (throw_on_early_termination=True); "
                                   "stopping every rank")
        return handle
