"""Assertions for parity tests, run on every rank."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from plait import comm


def chunk_sizes(size: int, n: int) -> list[int]:
    """The sizes torch.chunk gives a dim of `size` cut into `n` pieces, padded with zeros
    to `n` entries (size 7 on 4 -> [2, 2, 2, 1]; size 2 on 4 -> [1, 1, 0, 0])."""
    per = -(-size // n) if size else 0
    return [max(0, min(per, size - i * per)) for i in range(n)]


def assert_synced(tensor: torch.Tensor, group: ProcessGroup, *, atol: float = 0.0, rtol: float = 0.0,
                  name: str = "tensor") -> None:
    """Assert `tensor` is the same on every rank of `group` (exactly, by default)."""
    n, rank = comm.get_world_size(group), comm.get_rank(group)
    shapes = comm.all_gather(torch.tensor([tensor.dim(), *tensor.shape, 0, 0, 0, 0][:5], device=comm.group_device(group)),
                             group=group)
    if len({tuple(s) for s in shapes.view(n, -1).tolist()}) != 1:
        raise AssertionError(f"{name} has different shapes across ranks: {shapes.view(n, -1).tolist()}")
    everyone = comm.all_gather(tensor.detach().contiguous().reshape(1, -1), group=group)  # (n, numel)
    for other in range(n):
        if other == rank:
            continue
        if not torch.allclose(everyone[other].to(tensor.dtype), tensor.reshape(-1), atol=atol, rtol=rtol, equal_nan=True):
            diff = (everyone[other].double() - tensor.reshape(-1).double()).abs().max().item()
            raise AssertionError(
                f"{name} differs between group rank {rank} and rank {other}: max |diff| = {diff:.3g} "
                f"(atol={atol}, rtol={rtol})"
            )


def assert_shard_close(local: torch.Tensor, full: torch.Tensor, *, group: ProcessGroup, dim: int = 0,
                       atol: float = 1e-5, rtol: float = 1.3e-6, name: str = "shard") -> None:
    """Assert this rank's `local` equals its torch.chunk piece of the single-process
    reference `full` along `dim`."""
    n, rank = comm.get_world_size(group), comm.get_rank(group)
    sizes = chunk_sizes(full.size(dim), n)
    expected = full.narrow(dim, sum(sizes[:rank]), sizes[rank])
    if tuple(local.shape) != tuple(expected.shape):
        raise AssertionError(f"{name} on rank {rank} has shape {tuple(local.shape)}, expected {tuple(expected.shape)}")
    torch.testing.assert_close(local, expected.to(local.dtype), atol=atol, rtol=rtol,
                               msg=lambda m: f"{name} on rank {rank} differs from the reference: {m}")
