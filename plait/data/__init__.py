"""plait.data — stateful, data-parallel-aware sample streams that resume with the checkpoint.

- `StatefulDistributedSampler`: torch's DistributedSampler with a global `state_dict()`
  (epoch, seed, samples consumed), so a job resumed with another data-parallel degree continues
  the same global sample stream.
- `StatefulDataLoader`: torch's DataLoader whose state is the sampler's as of the last batch
  delivered (workers' prefetching is not counted as seen).
- `RNGState`: torch / CUDA / Python / numpy generators as one Stateful.

Layer: above the strategies and plait.checkpoint; imports only plait.comm from plait.
"""

from plait.data.loader import StatefulDataLoader
from plait.data.rng import RNGState
from plait.data.sampler import StatefulDistributedSampler

__all__ = ["RNGState", "StatefulDataLoader", "StatefulDistributedSampler"]
