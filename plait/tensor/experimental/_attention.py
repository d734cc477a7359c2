"""torch's module path for the context-parallel names: torch.distributed.tensor.experimental._attention
-> plait.tensor.experimental._attention (the code lives in cp_context.py)."""

from plait.tensor.experimental.cp_context import (
    _cp_options,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)

__all__ = ["_cp_options", "context_parallel", "context_parallel_unshard", "set_rotate_method"]
