"""scaled_dot_product_attention on CPU (what torch's sdpa lowers to there), forward and
backward, with heads or batch sharded.

    _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
        -> (out, logsumexp)                        q, k, v: (B, H, T, D); logsumexp (B, H, T)
    ..._backward(dy, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
        -> (dq, dk, dv)

Per mesh axis: all Replicate, or every (B, H, ...) tensor sharded on H (tensor-parallel
attention) or on B; a mask shards along when it has that dim at full size, else it is
Replicate. Heads are only sharded when q and k have the same number (no GQA) and there is
no dropout (a dropout mask could not match a single-process run). Backward is linear in
dy: a Partial dy gives Partial grads.
"""

from __future__ import annotations

import torch

from plait.tensor.ops.registry import OpCall, Sharding, aten, partial_ops, register
from plait.tensor.placement import Partial, Replicate, Shard
from plait.tensor.spec import DTensorSpec

FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _strategies(call: OpCall, q: DTensorSpec, k: DTensorSpec, mask: DTensorSpec | None,
                n_out: int, dropout_p: float) -> list:
    R = Replicate()
    n_in = len(call.specs)
    options = [((R,) * n_in, (R,) * n_out)]
    dims = [0] + ([1] if q.shape[1] == k.shape[1] and dropout_p == 0 else [])
    for d in dims:
        ins = []
        for s in call.specs:
            if s is mask:
                off = 4 - s.ndim
                ok = d - off >= 0 and s.shape[d - off] == q.shape[d]
                ins.append(Shard(d - off) if ok else R)
            else:
                ins.append(Shard(d))
        options.append((tuple(ins), (Shard(d),) * n_out))
    return options


def _skip_empty(op, dtypes):
    """The CPU kernels crash (SIGFPE) on a rank whose piece has no batch or no head: such a
    rank returns empty outputs shaped like its inputs instead."""

    def run(args, kwargs):
        q, v = (args[0], args[2]) if op is FWD else (args[1], args[3])
        if q.numel() and v.numel():
            return op(*args, **kwargs)
        if op is FWD:
            return (q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=dtypes[0]),
                    q.new_empty(q.shape[:-1], dtype=dtypes[1]))
        return tuple(torch.zeros_like(t) for t in args[1:4])

    return run


@register(FWD)
def sdpa_forward(call: OpCall) -> Sharding:
    q, k = call.args[0], call.args[1]
    mask = call.kwargs.get("attn_mask")
    dropout_p = call.arg(3, "dropout_p", 0.0)
    sharding = call.choose(_strategies(call, q, k, mask if isinstance(mask, DTensorSpec) else None,
                                       len(call.outs), dropout_p))
    return sharding.with_local_fn(_skip_empty(FWD, [o.dtype for o in call.outs]))


@register(BWD)
def sdpa_backward(call: OpCall) -> Sharding:
    q, k = call.args[1], call.args[2]
    mask = call.kwargs.get("attn_mask")
    dropout_p = call.arg(6, "dropout_p", 0.0)
    options = _strategies(call, q, k, mask if isinstance(mask, DTensorSpec) else None,
                          len(call.outs), dropout_p)
    dy = call.specs[0]
    R = Replicate()
    for op in partial_ops([dy]):
        ins = (Partial(op),) + (R,) * (len(call.specs) - 1)
        options.append((ins, (Partial(op),) * len(call.outs)))
    return call.choose(options).with_local_fn(_skip_empty(BWD, None))


__all__ = ["sdpa_backward", "sdpa_forward"]
