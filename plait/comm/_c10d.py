"""c10d's entry points, bound when plait.comm is imported.

plait.debug may wrap torch.distributed's public functions so that a user's direct calls
are traced too; plait's own calls go through these originals, so no op is seen twice.
"""

import torch.distributed as dist

all_reduce = dist.all_reduce
# torch 2.13 renamed the single-tensor forms and deprecated the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_to_all_single = dist.all_to_all_single
broadcast = dist.broadcast
reduce = dist.reduce
barrier = dist.barrier
send = dist.send
recv = dist.recv
isend = dist.isend
irecv = dist.irecv
batch_isend_irecv = dist.batch_isend_irecv
P2POp = dist.P2POp
ReduceOp = dist.ReduceOp
AllreduceOptions = dist.AllreduceOptions
BroadcastOptions = dist.BroadcastOptions
