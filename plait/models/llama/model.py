"""A Llama-style decoder written for parallelization.

    tokens (b, s) -> tok_embeddings -> h (b, s, dim)
    per block:  h = h + attention(attention_norm(h), rope)   RMSNorm, GQA through SDPA (causal)
                h = h + feed_forward(ffn_norm(h))             SwiGLU: w2(silu(w1 x) * w3 x)
    -> norm -> output -> logits (b, s, vocab)

Invariant: no module reads a head count or a width from ModelArgs in forward. Heads are
counted from the projections' outputs (`q.view(b, s, -1, head_dim)`), so when wq/wk/wv
are column-sharded over tp and hand back local tensors, the same code runs on
n_heads/tp and n_kv_heads/tp local heads; `head_dim` is a property of the model, not of
the sharding. The batch and sequence sizes come from the input, so under sequence
parallel a block sees the gathered sequence inside attention and the MLP.

Pipeline stages: `tok_embeddings`, `norm` and `output` may be None (a stage without the
first or last layers) and `layers` is a ModuleDict keyed by the layer index, so deleting
blocks keeps every other FQN (`layers.{i}.attention.wq`, torchtitan's names).

The rotary table is a non-persistent buffer (not in the state dict, recomputed by
`init_weights`), so a model built on the meta device and moved with `to_empty` is
initialized completely by `init_weights()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.llama.args import ModelArgs


def rope_table(head_dim: int, max_seq_len: int, theta: float, *, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2): cos and sin of position * theta^(-2i/head_dim), fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv)  # (s, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of x's last dim (Llama's interleaved convention).

    x: (b, s, heads, head_dim); table: (s, head_dim/2, 2). Computed in fp32, returned in x's dtype.
    """
    b, s, h, hd = x.shape
    pairs = x.float().reshape(b, s, h, hd // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # (b, s, h, hd/2)
    cos = table[:s, :, 0].view(1, s, 1, hd // 2)
    sin = table[:s, :, 1].view(1, s, 1, hd // 2)
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (b, s, h, hd/2, 2)
    return out.flatten(3).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, s, kv_heads, hd) -> (b, s, kv_heads * n_rep, hd): each KV head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, s, kv, hd = x.shape
    return x[:, :, :, None, :].expand(b, s, kv, n_rep, hd).reshape(b, s, kv * n_rep, hd)


class Attention(nn.Module):
    """Grouped-query attention; heads are counted from wq/wk's (possibly local) outputs."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        # (b, s, dim) @ (dim, heads/tp * hd) -> (b, s, heads/tp * hd): local heads under tp
        q = self.wq(x).view(b, s, -1, hd)
        k = self.wk(x).view(b, s, -1, hd)
        v = self.wv(x).view(b, s, -1, hd)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        n_rep = q.size(2) // k.size(2)  # n_heads // n_kv_heads, the same on every shard
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, hd)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (b, s, heads*hd) -> (b, s, dim)

    def init_weights(self, std: float, generator: torch.Generator | None) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=0.02, generator=generator)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std, generator=generator)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1/w3 column-sharded and w2 row-sharded under tp."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (b, s, hidden/tp) -> (b, s, dim)

    def init_weights(self, std: float, generator: torch.Generator | None) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02, generator=generator)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=std, generator=generator)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim())
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # torchtitan's depth init: later blocks' residual branches start smaller
        self.weight_init_std = 0.02 / (2 * (layer_id + 1 if args.depth_init else args.n_layers)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, generator: torch.Generator | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std, generator)
        self.feed_forward.init_weights(self.weight_init_std, generator)


class Transformer(nn.Module):
    """The decoder. `tok_embeddings`, `norm` and `output` may be set to None (pipeline stages)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._rope(None), persistent=False)

    def _rope(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return rope_table(a.head_dim, a.max_seq_len, a.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) int64, or hidden states (b, s, dim) on a stage without embeddings."""
        if tokens.size(1) > self.args.max_seq_len:
            raise ValueError(f"sequence length {tokens.size(1)} exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, *, seed: int | None = None, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and the rotary buffer, in a fixed order.

        Deterministic given `seed` (or, without one, torch's global RNG state), whatever
        happened before: building on the meta device and `to_empty` gives the same weights
        as building on the CPU, and tied weights are tied again. Call it before tensor-parallelizing (the source rank's
        weights are then distributed), as a plain module.
        """
        device = buffer_device or self.rope_cache.device
        if device.type == "meta":
            device = next(self.parameters()).device
        self.rope_cache = self._rope(device)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        tied = self.args.tie_embeddings
        if tied and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty unties them (one new tensor each)
        out_std = self.args.dim ** -0.5
        if self.tok_embeddings is not None:
            if tied:  # one weight serves both: the output's scale keeps the first logits O(1)
                nn.init.trunc_normal_(self.tok_embeddings.weight, mean=0.0, std=out_std,
                                      a=-3 * out_std, b=3 * out_std, generator=generator)
            else:
                nn.init.normal_(self.tok_embeddings.weight, generator=generator)
        for layer in self.layers.values():
            layer.init_weights(generator)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not (tied and self.tok_embeddings is not None):
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=out_std,
                                  a=-3 * out_std, b=3 * out_std, generator=generator)

    @classmethod
    def from_name(cls, name: str, **changes: object) -> Transformer:
        from plait.models.llama.args import CONFIGS

        if name not in CONFIGS:
            raise ValueError(f"no Llama config named {name!r}; known: {sorted(CONFIGS)}")
        return cls(CONFIGS[name].replace(**changes) if changes else CONFIGS[name])
