"""plait.tensor._ops — torch's module path for DTensor's op helpers
(torch.distributed.tensor._ops); plait's sharding rules live in plait.tensor.ops."""
