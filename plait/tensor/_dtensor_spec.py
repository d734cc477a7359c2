"""plait.tensor._dtensor_spec — torch's module path for the spec types
(torch.distributed.tensor._dtensor_spec): DTensorSpec (with `.tensor_meta` and `.shard_order`),
TensorMeta and ShardOrderEntry, all plait.tensor.spec's."""

from plait.tensor.spec import DTensorSpec, ShardOrderEntry, TensorMeta

__all__ = ["DTensorSpec", "ShardOrderEntry", "TensorMeta"]
