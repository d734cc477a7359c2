"""plait.tensor.placement_types — torch's module name for the placements (torch.distributed
.tensor.placement_types); they live in plait.tensor.placement."""

from plait.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = ["Partial", "Placement", "Replicate", "Shard", "_StridedShard"]
