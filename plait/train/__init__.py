"""plait.train — the reference trainer: config, N-D parallelize, loop, metrics.

    plait run --standalone --nproc-per-node 4 -m plait.train --config small --parallel.tp 2
    from plait.train import load, apply_overrides, train      # in-process, on an existing group
    result = train(apply_overrides(load("tiny"), ["--training.steps", "10"]))

Layers: `config` (TOML + overrides) -> `layout` (dims checked, the named mesh) -> `parallelize`
(TP -> activation checkpointing -> compile -> FSDP, pipeline stages) -> `trainer` (the loop)
with `metrics`; over `plait.data.text` (corpus, tokenizer, windows) and `plait.models.llama`.
The config and layout modules import no torch (`plait plan` reads them and starts fast), so
the names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"JobConfig": "plait.train.config", "apply_overrides": "plait.train.config",
            "from_dict": "plait.train.config", "load": "plait.train.config",
            "check": "plait.train.layout", "TrainResult": "plait.train.trainer", "train": "plait.train.trainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'plait.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
