"""plait.optim: torch.distributed.optim under plait (ZeroRedundancyOptimizer)."""
