"""Counting a framework's own host work: Python function calls per step, per rank.

    count_calls(fn) -> sys.setprofile on this thread, `fn()`, the number of 'call' events
    (Python frames entered, generator resumptions included; C functions are 'c_call' and
    not counted)

One thread per rank, and on CPU the autograd engine runs backward (and its Python hooks) on
the thread that called backward, so the count covers forward, backward and optimizer. It
does not see Python run on other threads (none of plait's step paths use one; a callback
Gloo runs on its own thread would be missed by both sides alike). Counted, not timed: the
figure does not depend on the machine's load, so a test may bound it.

The model both the benchmark (bench_host) and the regression test (tests/test_host_calls)
build: the Llama reference at dim 32, seq 8, so the step's compute is negligible and what
is left is the framework.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from plait.models.llama import ModelArgs, Transformer

SEQ = 8
BATCH = 2


def count_calls(fn: Callable[[], object]) -> int:
    """Python function calls made on this thread while `fn()` runs (a profiler hook)."""
    n = 0

    def hook(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return n - 1  # fn's own frame


def host_args(layers: int = 8) -> ModelArgs:
    """The Llama reference sized so its compute is negligible: dim 32, 4 heads (2 KV), vocab 64."""
    return ModelArgs(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                     max_seq_len=2 * SEQ)


def host_model(layers: int = 8, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(host_args(layers))
    model.init_weights(seed=seed)
    return model


def host_tokens(rank: int, batch: int = BATCH, seed: int = 0) -> torch.Tensor:
    """(batch, SEQ + 1) token ids, this rank's share of a global batch."""
    gen = torch.Generator().manual_seed(seed + rank)
    return torch.randint(64, (batch, SEQ + 1), generator=gen)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train_step(model, opt, tokens: torch.Tensor) -> Callable[[], None]:
    """One step: forward, loss, backward, AdamW, zero_grad."""

    def step() -> None:
        lm_loss(model(tokens[:, :-1]), tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
