"""Peak live tensor bytes of one training step, counted storage by storage (no allocator, no RSS).

    LiveBytes(seeds = state_tensors(modules, optimizers): what the step starts holding, i.e. the
              rank's local parameters, gradients, module buffers and optimizer state; + the batch)
      every tensor seen: the seeds, every op's outputs (a TorchDispatchMode; a DTensor output
      counts as its local tensor), every tensor autograd saves (saved_tensors_hooks)
      -> held by weak reference: alive as long as its TensorImpl is
      after every op: live = sum over distinct storages of the alive tensors of the storage's
      current nbytes -> peak = max(live)

It sees what activation checkpointing holds: the recompute's outputs are op outputs like any
other, so no saved-tensor hook of the checkpoint's hides them. A storage resized to 0 (FSDP's
freed unsharded parameters) counts 0 while freed. Views count once (their base's storage).
A tensor that exists before the step but is neither seeded nor an op's output in it is not
seen; seeding only the parameters left out AdamW's state (2 x the parameters + a step scalar
each), which no op outputs before the optimizer's step, so a peak in backward missed it.
The cost, a pass over the live tensors per op, is paid only in the step measured
(`--metrics.live_bytes true`: the second, when AdamW's state is alive
throughout as in every later step; plait plan --compare's timings leave it out). bench_fsdp
counts plait and torch by this same rule.
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


def state_tensors(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """What a step starts holding: parameters, gradients, buffers and every optimizer state tensor."""
    out: list[torch.Tensor] = []
    for m in modules:
        out += [p for p in m.parameters()] + [p.grad for p in m.parameters() if p.grad is not None]
        out += list(m.buffers())
    for o in optimizers:
        out += [v for state in o.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


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
