"""Peak live tensor bytes during a step, counted tensor by tensor (no allocator, no RSS).

    LiveBytes(seed=[params, grads, optimizer state, ...])
      every tensor seen: the seeds, every op's outputs (TorchDispatchMode; a DTensor output
      counts as its local tensor), every tensor autograd saves (saved_tensors_hooks)
      -> held by weak reference: alive as long as its TensorImpl is (torch keeps a
         tensor's Python object alive while C++ holds the tensor)
      after every op: live = sum over distinct storages of the alive tensors of the
      storage's current nbytes -> peak = max(live)

Reading the storage's current size means a buffer resized to 0 (FSDP's freed unsharded
parameters, plait's and torch's alike) counts 0 while freed and its full size once
refilled, though the resize itself is no op. Views share their base's storage and count
once. Used by bench_fsdp for plait and torch under the same rules; the cost (a pass over
the live tensors per op) is paid only in the step measured this way, never a timed one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _plain(t: torch.Tensor) -> torch.Tensor | None:
    local = getattr(t, "_local_tensor", None)  # a DTensor (plait's or torch's) holds no storage itself
    t = local if isinstance(local, torch.Tensor) else t
    return None if t.is_meta else t


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes(seeds) as live: step()`; then live.peak (bytes)."""

    def __init__(self, seeds: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}
        self.peak = 0
        for t in seeds:
            self._track(t)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._sample()

    def _track(self, t: object) -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = _plain(t)
        if t is not None and id(t) not in self._refs:
            key = id(t)
            self._refs[key] = weakref.ref(t, lambda _, key=key: self._refs.pop(key, None))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._track(t)
        return t

    def _sample(self) -> None:
        sizes: dict[int, int] = {}
        for ref in list(self._refs.values()):
            t = ref()
            if t is None:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr:
                sizes[ptr] = storage.nbytes()
        self.peak = max(self.peak, sum(sizes.values()))

    def __enter__(self) -> LiveBytes:
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        self._sample()
        return out


__all__ = ["LiveBytes"]
