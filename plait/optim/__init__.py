"""plait.optim: torch.distributed.optim under plait (ZeroRedundancyOptimizer)."""

# Placeholder export for the zero branch (the merge replaces this file): lets
# `from plait.optim import ZeroRedundancyOptimizer` work, lazily, as the porting rule promises.


def __getattr__(name: str) -> object:
    if name == "ZeroRedundancyOptimizer":
        from plait.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    raise AttributeError(f"module 'plait.optim' has no attribute {name!r}")
