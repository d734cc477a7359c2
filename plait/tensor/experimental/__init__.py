"""plait.tensor.experimental — torch's experimental DTensor APIs, by name and meaning.

    f = local_map(fn, out_placements=[Shard(0)], in_placements=([Shard(0)], None))
    y = f(x_dt, 2.0)                      # fn runs on x_dt's local piece; y is a DTensor
    with implicit_replication():          # a plain tensor mixed with DTensors is Replicate
        z = x_dt + torch.ones(4)
    @register_sharding(aten._softmax.default)   # a user's rule replaces plait's own
    def rule(x, dim, half): return [([Replicate()], [Replicate(), None, None])]
    with context_parallel(mesh["cp"], buffers=[tokens], buffer_seq_dims=[1]):
        loss = model(tokens).sum()        # SDPA inside is exact ring attention over cp

Files: func_map (local_map), replication (implicit_replication), cp_context
(context_parallel, context_parallel_unshard, set_rotate_method; the ring's math in
ring_attention, its block schedule in ring_plan); register_sharding lives
beside plait's own rules in plait.tensor.ops.registry (one chooser for both).
"""

from plait.tensor.experimental.cp_context import (
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from plait.tensor.experimental.func_map import local_map
from plait.tensor.experimental.replication import implicit_replication
from plait.tensor.ops.registry import register_sharding

__all__ = [
    "context_parallel", "context_parallel_unshard", "implicit_replication", "local_map",
    "register_sharding", "set_rotate_method",
]
