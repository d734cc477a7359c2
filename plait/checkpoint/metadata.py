"""The checkpoint's table of contents: `metadata.json`, written last, read first.

    Metadata
      tensors: fqn -> TensorMeta(shape, dtype, layout, chunks=[ChunkMeta(offsets, sizes,
               file, name, begin, nbytes, crc32)])   -- the chunks tile the global tensor once
      values:  fqn -> JSON (values.encode)           -- non-tensor state, rank 0's
      world_size, files
      file_meta: file -> FileMeta(size, header_nbytes, header_crc32)   (version 2)
      ..., "metadata_crc32": "<crc32 of every byte of this file before this key>"}   (version 2)

A chunk is one saved piece of a tensor: its place in the global tensor (offsets, sizes per
dim), where its bytes lie (file, byte range [begin, begin+nbytes)) and their zlib.crc32.
Every byte of a version-2 checkpoint is under a checksum: a tensor file is its header
(FileMeta.header_crc32 over bytes [0, header_nbytes)) followed by its chunks (each chunk's
crc32), exactly `size` bytes; metadata.json carries its own crc32 as its last key, so it
stays plain JSON and is committed by the same rename as before (commit.py). Version 1
(no file_meta, no metadata_crc32) still loads, with the chunks' checksums only.
Every field is checked when the file is read (validate.py: names confined to the folder,
chunks inside their tensor and file, tiling it exactly), once for every reader.
`layout` records how the tensor was laid out when saved (mesh shape, axis names,
placements), for `plait checkpoint inspect`; load never needs it, since the chunks say
where every element is.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # zlib-ng's crc32 is zlib's CRC-32, the same values, ~4.5x the bytes/s here (SIMD folding)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform without its wheel: the same checksums, slower
    from zlib import crc32

FORMAT = "plait-checkpoint"
VERSION = 2
READS = (1, 2)  # the versions this plait loads (1: before headers and metadata.json were checksummed)
METADATA_FILE = "metadata.json"
# the last bytes of a version-2 metadata.json; the crc32 covers every byte before the match
_TRAILER = re.compile(rb',\n "metadata_crc32": "([0-9a-f]{8})"\n\}\n\Z')


class CorruptCheckpointError(ValueError):
    """A checkpoint's bytes are not the ones saved: a checksum, size or parse failed."""

# torch dtype <-> safetensors dtype tag
_ST_TAGS = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {str(d).removeprefix("torch."): d for d in _ST_TAGS}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise ValueError(f"dtype {name!r} in checkpoint metadata is not one safetensors stores")
    return _BY_NAME[name]


def safetensors_tag(dtype: torch.dtype, *, key: str) -> str:
    if dtype not in _ST_TAGS:
        raise TypeError(f"state_dict[{key!r}] has dtype {dtype}, which safetensors cannot store "
                        f"(supported: {sorted(_BY_NAME)}); convert it (complex: torch.view_as_real)")
    return _ST_TAGS[dtype]


@dataclass
class ChunkMeta:
    offsets: list[int]
    sizes: list[int]
    file: str
    name: str  # the tensor's name inside the safetensors file
    begin: int
    nbytes: int
    crc32: int


@dataclass
class FileMeta:
    """A tensor file as written: `size` bytes, the first `header_nbytes` (length prefix,
    JSON header, padding) with crc32 `header_crc32`; the chunks' byte ranges are the rest."""

    size: int
    header_nbytes: int
    header_crc32: int


@dataclass
class TensorMeta:
    shape: list[int]
    dtype: str
    layout: dict[str, Any]
    chunks: list[ChunkMeta] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        n = dtype_from_name(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class Metadata:
    tensors: dict[str, TensorMeta]
    values: dict[str, Any]
    world_size: int
    files: list[str]
    file_meta: dict[str, FileMeta] = field(default_factory=dict)  # empty in a version-1 checkpoint
    # torch's Metadata fields, for planners and storage layers written against torch's DCP
    planner_data = None
    storage_meta = None
    version = None

    @functools.cached_property
    def state_dict_metadata(self) -> dict[str, Any]:
        """torch's view: fqn -> TensorStorageMetadata (chunks) | BytesStorageMetadata."""
        from plait.checkpoint.planner_api import state_dict_metadata_of

        return state_dict_metadata_of(self)

    @functools.cached_property
    def storage_data(self) -> dict[Any, ChunkMeta]:
        """MetadataIndex(fqn, chunk offsets) -> where the chunk's bytes are."""
        from plait.checkpoint.planner_api import MetadataIndex

        return {MetadataIndex(fqn, c.offsets): c for fqn, t in self.tensors.items() for c in t.chunks}

    def to_json(self) -> str:
        """One line per tensor, file and value, each encoded compactly by json's C encoder
        (indent= runs its pure-Python encoder: ~50k calls for a 64-tensor FSDP state); built
        from vars, not asdict, whose deep copy is ~5 calls a field. ASCII (ensure_ascii)."""
        enc = json.JSONEncoder(separators=(",", ":")).encode

        def obj(d: dict[str, Any], one) -> str:
            return "{" + ",".join(f"\n  {enc(k)}:{one(v)}" for k, v in d.items()) + ("\n }" if d else "}")

        def tensor(t: TensorMeta) -> str:
            return enc({"shape": t.shape, "dtype": t.dtype, "layout": t.layout, "chunks": [vars(c) for c in t.chunks]})

        head = (f'{{\n "format": {enc(FORMAT)},\n "version": {VERSION},\n "tensors": {obj(self.tensors, tensor)},'
                f'\n "values": {obj(self.values, enc)},\n "world_size": {enc(self.world_size)},'
                f'\n "files": {enc(self.files)},\n "file_meta": {obj(self.file_meta, lambda m: enc(vars(m)))}')
        return f'{head},\n "metadata_crc32": "{crc32(head.encode()):08x}"\n}}\n'

    @staticmethod
    def from_json(text: str | bytes, *, where: str) -> Metadata:
        """Parse metadata.json's bytes (checksum first, so a flipped byte is named as one)."""
        data = text.encode() if isinstance(text, str) else text
        trailer = _TRAILER.search(data)
        if trailer is not None:
            crc = crc32(data[:trailer.start()])
            if crc != int(trailer.group(1), 16):
                raise CorruptCheckpointError(f"checksum mismatch in {where}: crc32 {crc:#010x}, saved "
                                             f"{int(trailer.group(1), 16):#010x}")
        try:
            body = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where} ({len(data)} bytes) is not valid JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{where} is not plait checkpoint metadata (no format={FORMAT!r})")
        if body.get("version") not in READS:
            raise ValueError(f"{where} has format version {body.get('version')}; this plait reads {READS}")
        if body["version"] >= 2 and trailer is None:  # a v1 file has no trailer; a v2 one lost it
            raise CorruptCheckpointError(f"{where} is truncated or damaged at its end: its checksum (the "
                                         f'last key, "metadata_crc32") is missing or malformed')
        try:
            tensors = {
                k: TensorMeta(t["shape"], t["dtype"], t["layout"], [ChunkMeta(**c) for c in t["chunks"]])
                for k, t in body["tensors"].items()
            }
            files = {k: FileMeta(**f) for k, f in body.get("file_meta", {}).items()}
            md = Metadata(tensors, body["values"], body["world_size"], body["files"], files)
        except (KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where} lacks or mangles a field ({type(e).__name__}: {e})") from None
        from plait.checkpoint.validate import check  # imports this module

        return check(md, where)
