"""plait.checkpoint.state_dict — torch.distributed.checkpoint.state_dict for plait's layouts.

    from plait.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions
    model_sd, optim_sd = get_state_dict(model, optim)                       # DTensors, FQN keys
    full_sd, _ = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))  # rank 0
    set_state_dict(model, optim, model_state_dict=sd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

Layouts: plain modules, DistributedDataParallel ("module." dropped), replicate, fully_shard,
tensor parallel, FSDP + TP (2-D DTensors), pipeline-split stage modules, torch.compile'd
("_orig_mod." dropped) and checkpoint-wrapped ("_checkpoint_wrapped_module." dropped) modules.
Files: options (StateDictOptions), fqn (canonical names), full (gather / cut / broadcast),
model, optim (FQN-keyed optimizer state, flatten), api (the public functions).
"""

from plait.checkpoint.state_dict.api import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from plait.checkpoint.state_dict.optim import _init_optim_state
from plait.checkpoint.state_dict.options import StateDictKeyError, StateDictOptions

__all__ = [
    "StateDictKeyError", "StateDictOptions", "_init_optim_state", "get_model_state_dict",
    "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
    "set_state_dict",
]
