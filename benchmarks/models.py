"""Small models the benchmarks (and tests) share: a GPT-style decoder and its data.

    tokens (B, T) -> tok_emb + pos_emb -> n_layers x [LN -> causal attention -> +,
    LN -> MLP(4d, GELU) -> +] -> LN -> lm_head (tied to tok_emb) -> logits (B, T, vocab)

No buffers (the causal mask comes from scaled_dot_product_attention's is_causal), so a
data-parallel step communicates gradients only. No biases (nanoGPT's bias=False): the key
projection's bias has an exactly zero gradient (softmax ignores a shift shared by all keys),
and rounding noise there would make AdamW parity tests compare noise. `GPTConfig.small()` is the benchmark size
from the DDP issue: 4 layers, d_model 256, vocab 1024, sequence 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 1024
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    tie_weights: bool = True

    @staticmethod
    def small() -> GPTConfig:
        return GPTConfig()

    @staticmethod
    def tiny() -> GPTConfig:
        """For tests: a few thousand parameters, milliseconds per step."""
        return GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=False)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=False)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        nh, hs = self.n_heads, C // self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, averaged over the batch's positions."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def random_tokens(cfg: GPTConfig, batch: int, seed: int) -> torch.Tensor:
    """(batch, seq_len) token ids, the same for a seed on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
