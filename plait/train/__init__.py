"""plait.train — the reference trainer: config, N-D parallelize, loop, metrics.

    plait run --standalone --nproc-per-node 4 -m plait.train --config small --parallel.tp 2
    from plait.train import load, apply_overrides, train      # in-process, on an existing group
    result = train(apply_overrides(load("tiny"), ["--training.steps", "10"]))

Layers: `config` (TOML + overrides) -> `layout` (dims checked, the named mesh) -> `parallelize`
(TP -> activation checkpointing -> compile -> FSDP, pipeline stages) -> `trainer` (the loop)
with `metrics`; over `plait.data.text` (corpus, tokenizer, windows) and `plait.models.llama`.
"""

from plait.train.config import JobConfig, apply_overrides, from_dict, load
from plait.train.trainer import TrainResult, check, train

__all__ = ["JobConfig", "TrainResult", "apply_overrides", "check", "from_dict", "load", "train"]
