"""plait.models.llama — a Llama-style decoder, its named configs and its parallelization plan.

    from plait.models.llama import CONFIGS, Transformer
    torch.manual_seed(0)
    model = Transformer(CONFIGS["tiny"]); model.init_weights()
    logits = model(tokens)                        # (b, s) -> (b, s, vocab)
    parallelize_llama(model, mesh["tp"])          # or parallelize_module(model, mesh["tp"], tp_plan())

FQNs follow torchtitan (`tok_embeddings`, `layers.{i}.attention.wq`, `layers.{i}.ffn_norm`,
`norm`, `output`), so plans and checkpoints written for torchtitan's Llama apply.
"""

from __future__ import annotations

import importlib
from typing import Any

# `args` imports no torch (the planner reads ModelArgs and CONFIGS): the rest on first use
from plait.models.llama.args import CONFIGS, ModelArgs

_EXPORTS = {"Attention": "model", "FeedForward": "model", "Transformer": "model", "TransformerBlock": "model",
            "check_tp_degree": "parallelize", "parallelize_llama": "parallelize", "tp_plan": "parallelize"}

__all__ = ["CONFIGS", "ModelArgs", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'plait.models.llama' has no attribute {name!r}")
    return getattr(importlib.import_module(f"plait.models.llama.{_EXPORTS[name]}"), name)
