"""plait.tensor._ops.utils — torch's op helpers (torch.distributed.tensor._ops.utils)."""


def normalize_dim(dim: int, ndim: int) -> int:
    """A dim counted from the end (negative) as its index from the front."""
    return dim if dim >= 0 else dim + ndim


__all__ = ["normalize_dim"]
