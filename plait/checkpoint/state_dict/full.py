"""Full states: gather DTensors to plain tensors, cut plain full tensors to a rank's piece, and
broadcast rank 0's full state.

    get (full_state_dict):  DTensor --full_tensor() (collective over its mesh)--> plain tensor
                            [cpu_offload: -> .cpu(), and only global rank 0 keeps the state]
    set (full state):       plain full tensor + the local DTensor's (mesh, placements)
                            --distribute_tensor(src_data_rank=None): a local slice, no comm--> DTensor
    broadcast_from_rank0:   rank 0: JSON header (keys, shapes, dtypes, non-tensor values)
                            --broadcast (uint8)--> every rank; then each tensor in header order
                            --broadcast--> kept by the ranks whose model/optimizer has that key

Invariant: every rank walks the same keys in the same order (the header's, or the model's, which
SPMD layouts share), so the collectives match; a key problem is raised on every rank at once,
after the header and before any tensor is sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from plait import comm
from plait.tensor import DTensor, distribute_tensor


def gather_full(value: Any, *, cpu_offload: bool) -> Any:
    """Nested dicts/lists with every DTensor replaced by its full tensor (a collective)."""
    if isinstance(value, DTensor):
        full = value.full_tensor()
        return full.cpu() if cpu_offload else full
    if isinstance(value, torch.Tensor):
        return value.cpu() if cpu_offload else value
    if isinstance(value, dict):
        return {k: gather_full(v, cpu_offload=cpu_offload) for k, v in value.items()}
    if isinstance(value, list):
        return [gather_full(v, cpu_offload=cpu_offload) for v in value]
    return value


def offload(value: Any) -> Any:
    """cpu_offload without full_state_dict: each tensor's local piece on CPU (DTensors stay DTensors)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: offload(v) for k, v in value.items()}
    if isinstance(value, list):
        return [offload(v) for v in value]
    return value


def keeps_full_state(cpu_offload: bool) -> bool:
    """full_state_dict + cpu_offload: only global rank 0 keeps the gathered state (torch's rule)."""
    return not cpu_offload or not comm.is_initialized() or comm.global_rank() == 0


def to_local_layout(key: str, value: Any, local: Any) -> Any:
    """`value` (a plain full tensor, or anything) shaped like `local` (a DTensor or tensor)."""
    if not isinstance(value, torch.Tensor) or not isinstance(local, torch.Tensor):
        return value
    if isinstance(local, DTensor) and not isinstance(value, DTensor):
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(f"state dict key {key!r}: shape {tuple(value.shape)} != the model's "
                             f"{tuple(local.shape)} (global shape of its DTensor)")
        return distribute_tensor(value.to(local.device_mesh.device_type), local.device_mesh,
                                 local.placements, src_data_rank=None)
    if not isinstance(local, DTensor) and not isinstance(value, DTensor) and local.dim() > 0:
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(f"state dict key {key!r}: shape {tuple(value.shape)} != the model's "
                             f"{tuple(local.shape)}")
    return value


def _encode(value: Any, key: str) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, key) for v in value]}
    if isinstance(value, list):
        return [_encode(v, key) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, key), _encode(v, key)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"broadcast_from_rank0: {key!r} holds a {type(value).__name__}; only tensors and "
                    "JSON-like values (numbers, strings, None, tuples, lists, dicts) can be broadcast")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {_decode(k): _decode(v) for k, v in value["__dict__"]}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _broadcast_bytes(data: bytes | None, group: Any, device: torch.device) -> bytes:
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    comm.broadcast(size, src=0, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if data is not None:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    comm.broadcast(buf, src=0, group=group)
    return buf.cpu().numpy().tobytes()


def broadcast_flat(flat: dict[str, Any] | None, *, device: torch.device, wanted: Callable[[str], bool],
                   check: Callable[[list[str]], None]) -> dict[str, Any]:
    """Rank 0's `flat` (str keys -> tensors or JSON-like values) on every rank, keeping the keys
    `wanted` says; `check(keys)` runs on every rank on the header before any tensor moves."""
    group = comm.world_group()
    rank = comm.get_rank(group)
    header = None
    if rank == 0:
        assert flat is not None
        header = json.dumps([
            [k, "tensor", list(v.shape), str(v.dtype).removeprefix("torch.")] if isinstance(v, torch.Tensor)
            else [k, "value", _encode(v, k)] for k, v in flat.items()]).encode()
    entries = json.loads(_broadcast_bytes(header, group, device))
    check([e[0] for e in entries])
    out: dict[str, Any] = {}
    for entry in entries:
        key = entry[0]
        if entry[1] == "value":
            if wanted(key):
                out[key] = _decode(entry[2])
            continue
        shape, dtype = entry[2], getattr(torch, entry[3])
        if rank == 0:
            value = flat[key]  # type: ignore[index]
            buf = (value.full_tensor() if isinstance(value, DTensor) else value).detach().to(device).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        comm.broadcast(buf, src=0, group=group)
        if wanted(key):
            out[key] = buf
    return out
