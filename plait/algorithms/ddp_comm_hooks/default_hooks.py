"""torch's ddp_comm_hooks.default_hooks (implemented in plait.ddp.comm_hooks.default_hooks)."""

from plait.ddp.comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)

__all__ = ["allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
           "fp16_compress_wrapper"]
