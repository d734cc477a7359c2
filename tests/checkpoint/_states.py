"""A reference state dict and the same state laid out as DTensors on any mesh.

Values are random bits (every float pattern, bf16 included), compared bitwise with
torch.equal after a round trip: a checkpoint moves bytes and must not change one.
"""

from __future__ import annotations

import torch

from plait.device_mesh import init_device_mesh
from plait.tensor import DTensor, Replicate, Shard, _StridedShard, distribute_tensor

# name -> (shape, dtype): odd sizes so that no dim divides evenly by 2, 3 or 4
SHAPES = {
    "layer.w": ((7, 5), torch.float32),
    "layer.b": ((10,), torch.bfloat16),
    "emb": ((3, 4, 6), torch.int64),
    "tiny": ((2, 3), torch.float16),  # fewer rows than ranks on world 3 and 4
}

# layout name -> (mesh shape, placements for a tensor with >= 2 dims, for a 1-D tensor)
LAYOUTS = {
    "S0": (None, [Shard(0)], [Shard(0)]),
    "S1": (None, [Shard(1)], [Shard(0)]),
    "R": (None, [Replicate()], [Replicate()]),
    "S0xS1": ((2, -1), [Shard(0), Shard(1)], [Shard(0), Replicate()]),
    "RxS0": ((2, -1), [Replicate(), Shard(0)], [Replicate(), Shard(0)]),
    "S0xS0": ((2, -1), [Shard(0), Shard(0)], [Shard(0), Shard(0)]),
    # FSDP over TP, torch's layout: the dp axis cuts each tp piece (world 4: 2 x 2)
    "SSxS0": ((2, -1), [_StridedShard(0, split_factor=2), Shard(0)], [_StridedShard(0, split_factor=2), Shard(0)]),
    "SS1xS1": ((2, -1), [_StridedShard(1, split_factor=2), Shard(1)], [Shard(0), Replicate()]),
}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        n = torch.Size(shape).numel() * dtype.itemsize
        bits = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        out[name] = bits.view(dtype).view(shape).clone()
    return out


def mesh_of(layout: str, world_size: int):
    shape = LAYOUTS[layout][0]
    if shape is None:
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", (shape[0], world_size // shape[0]))


def laid_out(layout: str | None, world_size: int, *, zero: bool = False) -> dict:
    """The reference state as DTensors in `layout` (None: plain tensors), or zeros of it."""
    ref = reference()
    if zero:
        ref = {k: torch.zeros_like(v) for k, v in ref.items()}
    if layout is None:
        return ref
    mesh = mesh_of(layout, world_size)
    _, many, one = LAYOUTS[layout]
    return {k: distribute_tensor(v, mesh, many if v.dim() > 1 else one) for k, v in ref.items()}


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value
