"""ModelArgs: the Llama-style decoder's hyper-parameters, its named configs and its size.

    ModelArgs -> ffn_hidden_dim() (Llama's 2/3 * 4 * dim rounded up to multiple_of, or ffn_dim)
              -> num_params() (the closed form the tests hold the module to)

The named configs are small on purpose: "tiny" for tests (heads and KV heads divide by 1,
2 and 4), "tiny3" for a tensor-parallel degree of 3, "8m" (about 8M parameters) for
benchmarks. Their parameter counts are stated in tests/models/test_llama.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many as n_heads (multi-head attention)
    vocab_size: int = 32000
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None  # the SwiGLU hidden size itself, overriding the rule above
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False  # output.weight is tok_embeddings.weight
    depth_init: bool = True  # output projections' init std shrinks with the layer index

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim = dim ({self.dim}) // n_heads ({self.n_heads}) = "
                             f"{self.dim // self.n_heads} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self) -> int:
        """Parameters of Transformer(self), a tied weight counted once."""
        d, hd = self.dim, self.head_dim
        attention = d * self.n_heads * hd * 2 + d * self.kv_heads * hd * 2  # wq, wo; wk, wv
        mlp = 3 * d * self.ffn_hidden_dim()
        block = attention + mlp + 2 * d  # + attention_norm, ffn_norm
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + embeddings + d  # + final norm

    def replace(self, **changes: object) -> ModelArgs:
        return dataclasses.replace(self, **changes)


CONFIGS: dict[str, ModelArgs] = {
    # tests: heads 8 and KV heads 4 divide by tp 1, 2, 4; SwiGLU hidden 192
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, multiple_of=32,
                      max_seq_len=64),
    # tests at tp 3: heads 6, KV heads 3, hidden 144, vocab 96 all divide by 3
    "tiny3": ModelArgs(dim=48, n_layers=2, n_heads=6, n_kv_heads=3, vocab_size=96, multiple_of=24,
                       max_seq_len=64),
    # benchmarks: 7,999,744 parameters; heads 8, KV heads 4, hidden 704, vocab 4096 divide by 4
    "8m": ModelArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64,
                    max_seq_len=512),
}
