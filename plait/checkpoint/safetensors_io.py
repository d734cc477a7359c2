"""Write chunks as a safetensors file in one pass; read a chunk back by byte range, checked.

    file = u64 header length | JSON header {name: {dtype, shape, data_offsets}} | tensor bytes
    write_file(path, [(name, tensor)]) -> [(name, begin, nbytes, crc32)]  (begin: file offset)
    read_chunk(path, chunk, into=None) -> uint8 tensor of the chunk's bytes, crc32 verified

This is the safetensors layout exactly (any safetensors reader opens these files; the tests
open them with `safetensors.safe_open`), written here rather than with
`safetensors.torch.save_file` because that copies every tensor to a bytes object first
(one extra copy of the rank's state in memory), refuses tensors that share storage (tied
weights), and does not tell the byte range of each tensor, which the metadata records.
The checksum is computed on the bytes as they are written, so it costs one read of memory.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Sequence

import torch

from plait.checkpoint.metadata import ChunkMeta, safetensors_tag

_BLOCK = 64 << 20  # crc32 and write in blocks: bounded temporaries, GIL released by both


def _bytes_of(t: torch.Tensor):
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def write_file(path: str, tensors: Sequence[tuple[str, torch.Tensor]], *, sync: bool) -> list[tuple[str, int, int, int]]:
    header, cpu, offset = {}, [], 0
    for name, t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": safetensors_tag(t.dtype, key=name), "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        cpu.append((name, t, n))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data area to 8 bytes
    base = 8 + len(raw)
    out = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t, n in cpu:
            crc = 0
            if n:
                view = _bytes_of(t)
                for start in range(0, n, _BLOCK):
                    block = view[start:start + _BLOCK]
                    crc = zlib.crc32(block, crc)
                    f.write(block)
            out.append((name, base + header[name]["data_offsets"][0], n, crc))
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return out


class ChunkError(ValueError):
    """A saved chunk is missing, truncated or corrupted."""


def read_chunk(path: str, chunk: ChunkMeta, *, fqn: str, into: torch.Tensor | None = None) -> torch.Tensor:
    """The chunk's bytes (into `into`, a contiguous uint8 tensor of chunk.nbytes, if given)."""
    buf = torch.empty(chunk.nbytes, dtype=torch.uint8) if into is None else into
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise ChunkError(f"file {chunk.file!r} of tensor {fqn!r} is missing ({path})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < chunk.begin + chunk.nbytes:
            raise ChunkError(f"file {chunk.file!r} is truncated: {size} bytes, but tensor {fqn!r} "
                             f"(chunk at offsets {chunk.offsets}) lies at bytes "
                             f"[{chunk.begin}, {chunk.begin + chunk.nbytes})")
        f.seek(chunk.begin)
        view = buf.numpy()
        got = f.readinto(view)
        assert got == chunk.nbytes, (got, chunk.nbytes)
    crc = 0
    for start in range(0, chunk.nbytes, _BLOCK):
        crc = zlib.crc32(view[start:start + _BLOCK], crc)
    if crc != chunk.crc32:
        raise ChunkError(f"checksum mismatch in file {chunk.file!r} for tensor {fqn!r} (chunk at offsets "
                         f"{chunk.offsets}, sizes {chunk.sizes}, bytes [{chunk.begin}, "
                         f"{chunk.begin + chunk.nbytes})): crc32 {crc:#010x}, saved {chunk.crc32:#010x}; "
                         "the file is corrupted")
    return buf
