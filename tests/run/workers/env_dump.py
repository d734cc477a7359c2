"""Write every launcher variable this worker sees to env_a<attempt>_r<rank>.json, then say hello."""

import os
import sys

import _common

KEYS = [
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PLAIT_RESTART_COUNT",
    "PLAIT_MAX_RESTARTS", "PLAIT_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
]

_common.register()
_common.write(
    f"env_a{_common.attempt()}_r{_common.rank()}.json",
    {**{k: os.environ.get(k) for k in KEYS}, "argv": sys.argv, "file": __file__, "path0": sys.path[0],
     "name": __name__, "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0)},
)
print(f"hello from rank {_common.rank()} of {_common.world()}")
