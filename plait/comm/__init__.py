"""plait.comm — the one door to c10d.

Every collective and point-to-point op in plait passes through here: one place that
checks inputs before anything is sent, picks the fastest implementation per backend and
size, numbers each op per group, and reports it to the listeners `plait.debug` installs.

    from plait import comm
    comm.init_process_group()                 # from RANK, WORLD_SIZE, MASTER_ADDR, ...
    g = comm.world_group()
    comm.all_reduce(t, group=g, op="avg")     # in place
    full = comm.all_gather(shard, group=g, dim=1, sizes=[3, 3, 2])
    h = comm.reduce_scatter(full, group=g, async_op=True); piece = h.wait()
    y = comm.autograd.all_gather(x, group=g)  # reduce-scatter in backward
    y = comm.functional.all_reduce(x, g, "sum")  # traceable: inside torch.compile'd code
"""

from plait.comm import autograd, functional
from plait.comm.algorithms import choose as choose_algorithm
from plait.comm.algorithms import set_algorithm
from plait.comm.collectives import all_reduce, barrier, broadcast, reduce
from plait.comm.device import group_device
from plait.comm.events import (
    CommEvent,
    CommListener,
    add_listener,
    listeners,
    listening,
    remove_listener,
)
from plait.comm.gathers import all_gather, all_to_all, reduce_scatter
from plait.comm.group import (
    GroupInfo,
    StaleGroupError,
    default_backend,
    destroy_process_group,
    get_global_rank,
    get_rank,
    get_world_size,
    global_rank,
    group_info,
    init_process_group,
    is_initialized,
    new_group,
    world_group,
    world_size,
)
from plait.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from plait.comm.prepared import (
    PreparedAllReduce,
    PreparedBroadcast,
    prepare_all_reduce,
    prepare_broadcast,
)
from plait.comm.work import Handle

__all__ = [
    "CommEvent", "CommListener", "GroupInfo", "Handle", "P2POp", "PreparedAllReduce", "PreparedBroadcast",
    "StaleGroupError", "functional",
    "add_listener", "all_gather", "all_reduce", "all_to_all", "autograd", "barrier",
    "batch_isend_irecv", "broadcast", "choose_algorithm", "default_backend",
    "destroy_process_group", "get_global_rank", "group_device", "get_rank", "get_world_size", "global_rank",
    "group_info", "init_process_group", "irecv", "is_initialized", "isend", "listeners",
    "listening", "new_group", "prepare_all_reduce", "prepare_broadcast", "recv", "reduce", "reduce_scatter", "remove_listener", "send",
    "set_algorithm", "world_group", "world_size",
]

# plait.debug listens at this door: the flight recorder by default, more when PLAIT_* asks.
from plait.debug.activate import on_comm_import as _on_comm_import  # noqa: E402

_on_comm_import()
