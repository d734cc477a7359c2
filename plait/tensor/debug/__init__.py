"""plait.tensor.debug — torch's DTensor debugging tools, by name.

    with CommDebugMode() as mode:                 # plait.debug's counter at plait.comm's door
        y = x_dt @ w_dt
    mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
    visualize_sharding(x_dt, header="x")          # which rank holds which rows and columns
"""

from plait.debug.comm_mode import CommDebugMode
from plait.tensor.debug.visualize import visualize_sharding

__all__ = ["CommDebugMode", "visualize_sharding"]
