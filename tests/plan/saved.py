"""Measure, on a pool rank, what the planner predicts: `plait train` run in-process with its
parts and optimizers captured and its training forward/backward under saved_tensors_hooks.

    train(config) -> bytes sent by axis in the last step (the trainer's CommDebugMode count),
                     and its collective and point-to-point calls by axis (the same events)
                  -> local parameter bytes and AdamW state bytes (after the run)
                  -> peak bytes of live saved tensors over the steps (unique storages; a
                     parameter or a view of one is not an activation)
"""

from __future__ import annotations

from unittest import mock

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    from plait.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class SavedTensorPeak:
    """Live bytes of saved tensors: + a storage's bytes at its first pack, - at its last unpack."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, int], int] = {}
        self.current = self.peak = 0

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return None, t
        storage = _local(t).untyped_storage()
        if storage.nbytes() == 0:
            return None, t
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self.live:
            self.live[key] = 0
            self.current += key[1]
            self.peak = max(self.peak, self.current)
        self.live[key] += 1
        return key, t

    def unpack(self, packed):
        key, t = packed
        if key is not None and key in self.live:
            self.live[key] -= 1
            if self.live[key] == 0:
                del self.live[key]
                self.current -= key[1]
        return t


def measure(config) -> dict:
    from plait.train import trainer

    parts, optimizers, saved = [], [], SavedTensorPeak()
    build, forward_backward, adamw = trainer.build_parts, trainer._forward_backward, torch.optim.AdamW

    class RecordedAdamW(adamw):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            optimizers.append(self)

    def build_parts(*args, **kwargs):
        parts.append(build(*args, **kwargs))
        return parts[-1]

    calls: list[dict[str, int]] = []
    by_axis = trainer.M.bytes_by_axis

    def counted(events, dims):  # the step's calls per axis label, as its bytes are labelled
        step: dict[str, int] = {}
        for e in events:
            label = trainer.M.axis_label(e.group_ranks, dims)
            if label:
                step[label] = step.get(label, 0) + 1
        calls.append(step)
        return by_axis(events, dims)

    def traced(p, batch, *, train: bool, **kwargs):
        if not train:
            return forward_backward(p, batch, train=train, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            return forward_backward(p, batch, train=train, **kwargs)

    with mock.patch.object(trainer, "build_parts", build_parts), \
            mock.patch.object(trainer, "_forward_backward", traced), mock.patch.object(torch.optim, "AdamW", RecordedAdamW), \
            mock.patch.object(trainer.M, "bytes_by_axis", counted):
        result = trainer.train(config)
    params = sum(_local(p).numel() * _local(p).element_size() for m in parts[0].modules for p in m.parameters())
    state = sum(_local(v).numel() * _local(v).element_size() for o in optimizers for s in o.state.values()
                for v in s.values() if torch.is_tensor(v))
    return {"bytes": result.bytes_sent_by_axis[-1], "calls": calls[-1], "params": params, "optimizer": state,
            "activations": saved.peak}
