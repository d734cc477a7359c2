"""plait.tensor.parallel — tensor and sequence parallel as a plan of styles (torch's API).

    tp = init_device_mesh("cpu", (world_size,))        # or mesh["tp"] of an N-D mesh
    parallelize_module(block, tp, {
        "attention_norm": SequenceParallel(),                           # x: Shard(1)
        "attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "attention.wq": ColwiseParallel(), ...,                         # all-gather before
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),       # reduce-scatter after
    })
    with loss_parallel():
        F.cross_entropy(logits, target).backward()                     # logits Shard(-1)

Data flow: a style turns a module's parameters into DTensors (style.py) and installs
hooks that give its inputs and outputs declared placements (layouts.py, prepare.py); the
DTensor sharding rules between the hooks insert the collectives. Files: api.py (plan
resolution, checks before anything is applied), style.py, prepare.py, loss.py.
"""

from plait.tensor.parallel.api import parallelize_module
from plait.tensor.parallel.loss import loss_parallel
from plait.tensor.parallel.prepare import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from plait.tensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput", "RowwiseParallel",
    "SequenceParallel", "loss_parallel", "parallelize_module",
]
