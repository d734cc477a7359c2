"""DDP communication hooks: how a bucket of gradients is reduced.

    ddp.register_comm_hook(state, hook)      hook(state, bucket) -> Future[Tensor]

`default_hooks`: plain average (`allreduce_hook`), 16-bit compression (`fp16_compress_hook`,
`bf16_compress_hook`) and wrappers that run any hook in 16 bits. `powerSGD_hook`: low-rank
compression (`PowerSGDState`, `powerSGD_hook`, `batched_powerSGD_hook`). `post_localSGD_hook`:
global then local gradient averaging (`PostLocalSGDState`, `post_localSGD_hook`). Module names
follow torch's `torch.distributed.algorithms.ddp_comm_hooks`, so imports port one to one.
"""

from plait.ddp.comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from plait.ddp.comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from plait.ddp.comm_hooks.post_localSGD_hook import PostLocalSGDState
from plait.ddp.comm_hooks.powerSGD_hook import PowerSGDState, batched_powerSGD_hook

__all__ = [
    "PostLocalSGDState", "PowerSGDState", "allreduce_hook", "batched_powerSGD_hook", "bf16_compress_hook",
    "bf16_compress_wrapper", "default_hooks", "fp16_compress_hook", "fp16_compress_wrapper",
    "post_localSGD_hook", "powerSGD_hook",
]
