"""Input checks that run before anything is sent: a bad call raises here, on the rank
that made it, with the numbers — it never reaches the wire to hang or corrupt a peer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.comm.group import GroupInfo

# dtypes each backend moves and reduces natively. Data-movement ops (gather, broadcast,
# all-to-all, p2p) carry any other dtype as raw bytes; reductions refuse it.
NATIVE_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "gloo": frozenset({
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
        torch.complex128, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
    }),
}
DEVICE_TYPES: dict[str, frozenset[str]] = {"gloo": frozenset({"cpu", "cuda"}), "nccl": frozenset({"cuda"})}

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def is_native(dtype: torch.dtype, backend: str) -> bool:
    native = NATIVE_DTYPES.get(backend)
    return native is None or dtype in native


def tensor(t: object, name: str, info: GroupInfo, *, in_place: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    devices = DEVICE_TYPES.get(info.backend)
    if devices is not None and t.device.type not in devices:
        raise ValueError(
            f"{name} is on {t.device} but group {info.name} uses backend {info.backend}, "
            f"which takes tensors on {sorted(devices)}; move it with .to(...) first"
        )
    if in_place and not t.is_contiguous():
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} with stride {t.stride()} is not contiguous and "
            f"this op writes into it; pass a contiguous tensor (e.g. t.contiguous()) and copy back"
        )
    return t


def reduce_op(op: object, dtype: torch.dtype, backend: str) -> str:
    name = getattr(op, "name", op)  # accept torch's ReduceOp too
    name = str(name).lower()
    if name == "prod":
        name = "product"
    if name not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose from {list(REDUCE_OPS)}")
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"avg of {dtype} is not representable; reduce with 'sum' and divide yourself")
    if not is_native(dtype, backend):
        raise TypeError(f"backend {backend} cannot reduce {dtype}; cast to a supported dtype first")
    return name


def dim(d: int, t: torch.Tensor, name: str) -> int:
    if t.dim() == 0:
        raise ValueError(f"{name} is a 0-dim tensor; reshape it to (1,) to gather or scatter it")
    if not -t.dim() <= d < t.dim():
        raise ValueError(f"dim {d} is out of range for {name} of shape {tuple(t.shape)}")
    return d % t.dim()


def split_sizes(sizes: Sequence[int], n: int, total: int | None, what: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != n:
        raise ValueError(f"{what} has {len(sizes)} entries but the group has {n} ranks")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{what} {sizes} has a negative size")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"{what} {sizes} add up to {sum(sizes)}, not {total}")
    return sizes


def peer(p: int, info: GroupInfo, what: str) -> int:
    if not 0 <= p < info.size:
        raise ValueError(f"{what} {p} is not a rank of group {info.name} (size {info.size})")
    if p == info.rank:
        raise ValueError(f"{what} {p} is this rank itself; point-to-point needs another rank")
    return p
