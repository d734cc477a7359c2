"""RNGState: the process's random generators as a `Stateful` for a checkpoint's state dict.

    {"rng": RNGState()}  --state_dict()-->  {"torch": uint8 tensor, "cuda": [uint8 tensor per device],
                                              "python": int64 tensor (625,), "python_gauss": float|None,
                                              "numpy": uint32->int64 tensor (624,), "numpy_pos": int, ...}

Invariant: `load_state_dict(state_dict())` puts every generator back, so the next draws of
`torch.rand`, `random.random` and `numpy.random.rand` equal the uninterrupted run's. Large states
are tensors (stored as tensors), small ones plain Python values (JSON in a checkpoint); nothing
needs pickle.

These are one process's generators. A distributed checkpoint stores a plain tensor once, as DCP
does, so generators that differ per rank need a per-rank key (`{f"rng.{rank}": RNGState()}`);
after a change of data-parallel degree there is no per-rank stream to continue for a new rank, so
resume-with-another-degree scripts reseed per rank from the step count instead.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """`state_dict()` / `load_state_dict()` over torch (CPU, and CUDA when initialised), Python
    `random` and numpy's global generator."""

    def __init__(self, *, cuda: bool | None = None) -> None:
        # None: CUDA states only where CUDA is already in use (initialising it costs seconds)
        self.cuda = cuda

    def _with_cuda(self) -> bool:
        if self.cuda is None:
            return torch.cuda.is_available() and torch.cuda.is_initialized()
        return self.cuda

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python_version": version,
            "python": torch.tensor(internal, dtype=torch.int64),  # (625,): 624 words and the position
            "python_gauss": gauss,
        }
        if self._with_cuda():
            state["cuda"] = torch.cuda.get_rng_state_all()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state.update(numpy_kind=kind, numpy=torch.from_numpy(keys.astype(np.int64)), numpy_pos=int(pos),
                     numpy_has_gauss=int(has_gauss), numpy_gauss=float(cached))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"torch", "python", "python_version", "python_gauss"} - set(state_dict)
        if missing:
            raise ValueError(f"RNGState: state is missing {sorted(missing)}; got keys {sorted(state_dict)}")
        torch.set_rng_state(state_dict["torch"])
        internal = tuple(int(v) for v in state_dict["python"].tolist())
        random.setstate((int(state_dict["python_version"]), internal, state_dict["python_gauss"]))
        if "cuda" in state_dict and self._with_cuda():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
        if "numpy" in state_dict:
            keys = state_dict["numpy"].numpy().astype(np.uint32)
            np.random.set_state((state_dict["numpy_kind"], keys, int(state_dict["numpy_pos"]),
                                 int(state_dict["numpy_has_gauss"]), float(state_dict["numpy_gauss"])))
