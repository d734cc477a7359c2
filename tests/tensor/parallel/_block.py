"""A Megatron-style transformer block for the tests (not plait.models): RMSNorm,
attention (wq/wk/wv/wo, causal SDPA), RMSNorm, SwiGLU MLP (w1/w2/w3), residuals; and its
canonical plans. Head counts are read from the local width of wq's output, so the same
code runs sharded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.tensor import Replicate, Shard
from plait.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, S, H_local * hd) each
        b, s = q.shape[0], q.shape[1]
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H_local, S, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, H_local * hd) -> (B, S, dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int = 12, n_heads: int = 4, hidden: int = 24) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def make_block(dim: int = 12, n_heads: int = 4, hidden: int = 24, dtype=torch.float32, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    block = Block(dim, n_heads, hidden).to(dtype)
    for norm in (block.attention_norm, block.ffn_norm):  # non-trivial norm weights
        nn.init.uniform_(norm.weight, 0.5, 1.5)
    return block


def tp_plan() -> dict:
    """TP alone: each region's input is one Replicate DTensor shared by its colwise
    linears, so backward all-reduces their summed gradient once."""
    region = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate())
    return {
        "attention": region,
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward": region,
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def sp_plan() -> dict:
    """TP+SP: norms on Shard(1); an all-gather into each region, a reduce-scatter out."""
    region = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    return {
        "attention_norm": SequenceParallel(),
        "attention": region,
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": region,
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallel_block(block: Block, mesh, sp: bool) -> Block:
    plan = sp_plan() if sp else tp_plan()
    return parallelize_module(block, mesh, plan)
