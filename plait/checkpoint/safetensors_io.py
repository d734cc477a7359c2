"""Write chunks as a safetensors file in one pass; read a chunk back by byte range, checked.

    file = u64 header length | JSON header {name: {dtype, shape, data_offsets}} | tensor bytes
    write_file(path, [(name, tensor)]) -> [(name, begin, nbytes, crc32)]  (begin: file offset)
        .file_meta: FileMeta(size, header_nbytes, header_crc32) of the whole file
    check_file(path, meta, ...)  -> the file's size and its header's crc32 as saved, or ChunkError
    read_chunk(path, chunk, into=None) -> uint8 tensor of the chunk's bytes, crc32 verified

This is the safetensors layout exactly (any safetensors reader opens these files; the tests
open them with `safetensors.safe_open`), written here rather than with
`safetensors.torch.save_file` because that copies every tensor to a bytes object first
(one extra copy of the rank's state in memory), refuses tensors that share storage (tied
weights), and does not tell the byte range of each tensor, which the metadata records.
The checksums (each chunk's, the header's) are computed on the bytes as they are written,
so they cost one read of memory and no read of the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import torch

from plait.checkpoint.confine import open_regular
from plait.checkpoint.metadata import (
    ChunkMeta,
    CorruptCheckpointError,
    FileMeta,
    crc32,
    safetensors_tag,
)

_BLOCK = 64 << 20  # crc32 and write in blocks: bounded temporaries, GIL released by both


def _bytes_of(t: torch.Tensor):
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class WrittenFile(list):
    """write_file's result: [(name, begin, nbytes, crc32)] per tensor, as callers iterate it,
    plus `file_meta`, which covers the bytes the chunks do not (the header) and the size."""

    file_meta: FileMeta


def write_file(path: str, tensors: Sequence[tuple[str, torch.Tensor]], *, sync: bool) -> WrittenFile:
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
    head = struct.pack("<Q", len(raw)) + raw
    base = len(head)
    out = WrittenFile()
    out.file_meta = FileMeta(size=base + offset, header_nbytes=base, header_crc32=crc32(head))
    with open(path, "wb") as f:
        f.write(head)
        for name, t, n in cpu:
            crc = 0
            if n:
                view = _bytes_of(t)
                for start in range(0, n, _BLOCK):
                    block = view[start:start + _BLOCK]
                    crc = crc32(block, crc)
                    f.write(block)
            out.append((name, base + header[name]["data_offsets"][0], n, crc))
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return out


class ChunkError(CorruptCheckpointError):
    """A saved chunk or its file is missing, truncated or corrupted."""


def _tensors(fqns: Sequence[str]) -> str:
    """"tensor 'a'", or "tensor 'a' and 2 more ('b', 'c')": the tensors a file holds."""
    names = sorted(set(fqns)) or ["?"]
    more = names[1:]
    shown = ", ".join(map(repr, more[:3])) + (", ..." if len(more) > 3 else "")
    return f"tensor {names[0]!r}" + (f" and {len(more)} more ({shown})" if more else "")


def check_file(path: str, meta: FileMeta, *, file: str, fqns: Sequence[str]) -> None:
    """The file is `meta.size` bytes and its header has the saved crc32 (`fqns`: the tensors
    it holds, for the message). Reads only the header."""
    try:
        f = open_regular(path, what=f"file {file!r} of {_tensors(fqns)}")
    except FileNotFoundError:
        raise ChunkError(f"file {file!r} of {_tensors(sorted(set(fqns))[:1])} is missing ({path}); it held {_tensors(fqns)}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != meta.size:
            what = "is truncated" if size < meta.size else "has grown"
            raise ChunkError(f"file {file!r} {what}: {size} bytes, saved {meta.size}; it holds {_tensors(fqns)}")
        crc = crc32(f.read(meta.header_nbytes))
    if crc != meta.header_crc32:
        raise ChunkError(f"checksum mismatch in the safetensors header of file {file!r} (bytes [0, "
                         f"{meta.header_nbytes}), the index of {_tensors(fqns)}): crc32 {crc:#010x}, "
                         f"saved {meta.header_crc32:#010x}")


def read_chunk(path: str, chunk: ChunkMeta, *, fqn: str, into: torch.Tensor | None = None) -> torch.Tensor:
    """The chunk's bytes (into `into`, a contiguous uint8 tensor of chunk.nbytes, if given);
    the buffer is allocated once the file is known to hold them, and filled entirely or refused."""
    try:
        f = open_regular(path, what=f"file {chunk.file!r} of tensor {fqn!r}")
    except FileNotFoundError:
        raise ChunkError(f"file {chunk.file!r} of tensor {fqn!r} is missing ({path})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < chunk.begin + chunk.nbytes:
            raise ChunkError(f"file {chunk.file!r} is truncated: {size} bytes, but tensor {fqn!r} "
                             f"(chunk at offsets {chunk.offsets}) lies at bytes "
                             f"[{chunk.begin}, {chunk.begin + chunk.nbytes})")
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8) if into is None else into
        f.seek(chunk.begin)
        view = buf.numpy()
        got = f.readinto(view) or 0
        if got != chunk.nbytes:  # the file shrank since fstat: the rest of buf is not the file's
            raise ChunkError(f"file {chunk.file!r} gave {got} of the {chunk.nbytes} bytes of tensor {fqn!r} "
                             f"(chunk at offsets {chunk.offsets}, bytes [{chunk.begin}, "
                             f"{chunk.begin + chunk.nbytes})): it is being truncated")
    crc = 0
    for start in range(0, chunk.nbytes, _BLOCK):
        crc = crc32(view[start:start + _BLOCK], crc)
    if crc != chunk.crc32:
        raise ChunkError(f"checksum mismatch in file {chunk.file!r} for tensor {fqn!r} (chunk at offsets "
                         f"{chunk.offsets}, sizes {chunk.sizes}, bytes [{chunk.begin}, "
                         f"{chunk.begin + chunk.nbytes})): crc32 {crc:#010x}, saved {chunk.crc32:#010x}; "
                         "the file is corrupted")
    return buf
