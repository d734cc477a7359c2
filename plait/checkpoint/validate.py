"""metadata.json checked once, when read, so every reader (load, verify, consolidate, inspect,
generate) can trust each number in it.

    Metadata.from_json -> check(md, where), in this order:
      fields    world_size an int >= 1, files a list, values a dict; every int in [0, 2**63)
      names     every file named (`files`, `file_meta`, each chunk's) -> confine.check_name
      files     file_meta: header_nbytes in [8, size]
      tensor    shape ints, dtype one safetensors stores, layout a dict of lists
      chunk     offsets and sizes of the tensor's rank, inside its shape; its bytes
                [begin, begin + nbytes): nbytes = numel * itemsize, past its file's header and
                inside the file's recorded size (version 2: file_meta has every chunk's file)
      tiling    the chunks do not overlap and together cover the tensor exactly (_tiling)
      values    each decodes (values.decode; a custom planner's raw bytes: their base64)
    -> CorruptCheckpointError naming the tensor and the chunk (its index, offsets and sizes)

The crc32 of metadata.json detects a flipped bit, not a crafted file: whoever writes one can
recompute it. So nothing here trusts the file to be plait's: a duplicated, missing or
out-of-bounds chunk would leave elements of a torch.empty tensor unwritten (uninitialised
memory handed out as weights), a negative or huge byte range reads elsewhere or allocates
petabytes, a name with a path reads outside the folder.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import itertools
import math
import os
from typing import Any

import numpy as np

from plait.checkpoint import values as values_mod
from plait.checkpoint.confine import check_name, open_regular
from plait.checkpoint.metadata import (
    METADATA_FILE,
    ChunkMeta,
    CorruptCheckpointError,
    Metadata,
    TensorMeta,
    dtype_from_name,
)

_INT_LIMIT = 1 << 63  # offsets, sizes and byte counts fit an int64 (numpy, torch, the OS)
_GRID_CELLS = 1 << 22  # a tiling checked on the grid of its chunks' boundaries up to this many cells


def _int(v: object, what: str, *, low: int = 0) -> int:
    if type(v) is not int or not low <= v < _INT_LIMIT:
        raise CorruptCheckpointError(f"{what} is {v!r}, not an integer in [{low}, 2**63)")
    return v


def _ints(v: object, what: str, rank: int | None = None) -> list[int]:
    if not isinstance(v, list) or (rank is not None and len(v) != rank):
        want = "a list" if rank is None else f"a list of {rank} integers (the tensor's rank)"
        raise CorruptCheckpointError(f"{what} is {v!r}, not {want}")
    for x in v:
        if type(x) is not int or not 0 <= x < _INT_LIMIT:
            raise CorruptCheckpointError(f"{what} is {v!r}: {x!r} is not an integer in [0, 2**63)")
    return v


def read(folder: str) -> Metadata:
    """FOLDER/metadata.json (a regular file, not a link, as every file the checkpoint names),
    parsed and checked."""
    where = os.path.join(folder, METADATA_FILE)
    with open_regular(where, what=METADATA_FILE) as f:
        return Metadata.from_json(f.read(), where=where)


def check(md: Metadata, where: str) -> Metadata:
    """`md` if every field is sound; CorruptCheckpointError naming `where` and the entry otherwise."""
    try:
        _check(md)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    return md


def _check(md: Metadata) -> None:
    _int(md.world_size, "world_size", low=1)
    for name, v, kind in (("files", md.files, list), ("values", md.values, dict), ("tensors", md.tensors, dict)):
        if not isinstance(v, kind):
            raise CorruptCheckpointError(f"{name} is a {type(v).__name__}, not a JSON {'array' if kind is list else 'object'}")
    for f in md.files:
        check_name(f, what="files")
    for f, m in md.file_meta.items():
        check_name(f, what="file_meta")
        _int(m.size, f"file_meta[{f!r}].size")
        _int(m.header_nbytes, f"file_meta[{f!r}].header_nbytes", low=8)
        _int(m.header_crc32, f"file_meta[{f!r}].header_crc32")
        if m.header_nbytes > m.size:
            raise CorruptCheckpointError(f"file_meta[{f!r}]: a header of {m.header_nbytes} bytes in a file of {m.size}")
    for fqn, t in md.tensors.items():
        _tensor(fqn, t, md)
    for fqn, v in md.values.items():
        _value(fqn, v)


def _tensor(fqn: str, t: TensorMeta, md: Metadata) -> None:
    shape = _ints(t.shape, f"tensor {fqn!r}: shape")
    if not isinstance(t.dtype, str):
        raise CorruptCheckpointError(f"tensor {fqn!r}: dtype {t.dtype!r} is not a name")
    try:
        itemsize = dtype_from_name(t.dtype).itemsize
    except ValueError as e:
        raise CorruptCheckpointError(f"tensor {fqn!r}: {e}") from None
    _layout(fqn, t.layout)
    if not isinstance(t.chunks, list):
        raise CorruptCheckpointError(f"tensor {fqn!r}: chunks is not a list")
    for i, c in enumerate(t.chunks):
        if not _chunk_ok(c, shape, itemsize, md.file_meta):  # the cheap test; the slow one says why
            _chunk_problem(fqn, i, c, shape, t.dtype, itemsize, md.file_meta)
    _tiling(fqn, shape, t.chunks)


def _chunk_ok(c: ChunkMeta, shape: list[int], itemsize: int, file_meta: dict[str, Any]) -> bool:
    o, s = c.offsets, c.sizes
    if type(o) is not list or type(s) is not list or len(o) != len(shape) or len(s) != len(shape):
        return False
    n = itemsize
    for a, b, m in zip(o, s, shape):
        if type(a) is not int or type(b) is not int or a < 0 or b < 0 or a + b > m:
            return False
        n *= b
    begin, nbytes, crc, name, file = c.begin, c.nbytes, c.crc32, c.name, c.file
    if (type(begin) is not int or type(nbytes) is not int or type(crc) is not int or type(name) is not str
            or type(file) is not str or nbytes != n or begin < 0 or not 0 <= crc < _INT_LIMIT
            or begin + nbytes >= _INT_LIMIT or not file or file in (".", "..") or "/" in file or "\\" in file
            or "\0" in file):
        return False
    meta = file_meta.get(file) if file_meta else None
    return not file_meta or (meta is not None and meta.header_nbytes <= begin and begin + nbytes <= meta.size)


def _chunk_problem(fqn: str, i: int, c: ChunkMeta, shape: list[int], dtype: str, itemsize: int,
                   file_meta: dict[str, Any]) -> None:
    """Raise what is wrong with chunk `i` (_chunk_ok said something is)."""
    what = f"tensor {fqn!r} chunk {i}"
    offsets = _ints(c.offsets, f"{what}: offsets", len(shape))
    sizes = _ints(c.sizes, f"{what}: sizes", len(shape))
    what += f" (offsets {offsets}, sizes {sizes})"
    if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
        raise CorruptCheckpointError(f"{what} reaches outside the tensor's shape {shape}")
    check_name(c.file, what=what)
    if not isinstance(c.name, str):
        raise CorruptCheckpointError(f"{what}: name {c.name!r} is not a string")
    begin, nbytes = _int(c.begin, f"{what}: begin"), _int(c.nbytes, f"{what}: nbytes")
    _int(c.crc32, f"{what}: crc32")
    _int(begin + nbytes, f"{what}: begin + nbytes")
    if nbytes != math.prod(sizes) * itemsize:
        raise CorruptCheckpointError(f"{what}: nbytes {nbytes}, but {math.prod(sizes)} elements of "
                                     f"{dtype} are {math.prod(sizes) * itemsize} bytes")
    meta = file_meta.get(c.file)  # version 2: the file's recorded size bounds its chunks (checked on read)
    if meta is None:
        raise CorruptCheckpointError(f"{what} lies in file {c.file!r}, which file_meta does not record")
    raise CorruptCheckpointError(f"{what}: bytes [{begin}, {begin + nbytes}) are not in the data of "
                                 f"file {c.file!r}, bytes [{meta.header_nbytes}, {meta.size})")


def _layout(fqn: str, layout: Any) -> None:
    ok = isinstance(layout, dict) and all(isinstance(layout.get(k, []), list) for k in ("placements", "mesh_shape"))
    ok = ok and isinstance(layout.get("mesh_dim_names") or [], list) and isinstance(layout.get("from", ""), str)
    if not ok:
        raise CorruptCheckpointError(f"tensor {fqn!r}: layout {layout!r} is not plait's (lists of placements, "
                                     "mesh_shape, mesh_dim_names)")


def _chunk(fqn: str, i: int, c: ChunkMeta) -> str:
    return f"tensor {fqn!r} chunk {i} (offsets {c.offsets}, sizes {c.sizes})"


def _tiling(fqn: str, shape: list[int], chunks: list[ChunkMeta]) -> None:
    """The non-empty chunks cover each element of `shape` exactly once; no two chunks share
    offsets (a chunk is found by them). Typical layouts take a fast path: one whole chunk, or
    slices along one dim; any other, the grid of all the chunks' boundaries, each chunk
    marking its cells (bounded: _GRID_CELLS), else pairwise."""
    at: dict[tuple[int, ...], int] = {}
    for i, c in enumerate(chunks):
        j = at.setdefault(tuple(c.offsets), i)
        if j != i:
            raise CorruptCheckpointError(f"{_chunk(fqn, i, c)} is at the offsets of chunk {j}")
    full = [(i, c) for i, c in enumerate(chunks) if math.prod(c.sizes)]
    numel = math.prod(shape)
    if numel == 0:
        if full:  # cannot be: inside an empty shape a chunk is empty
            raise CorruptCheckpointError(f"{_chunk(fqn, *full[0])} in a tensor of shape {shape}")
        return
    if not full:
        raise CorruptCheckpointError(f"tensor {fqn!r} of shape {shape} has no chunk: element "
                                     f"{[0] * len(shape)} is in none")
    if len(full) == 1 and list(full[0][1].sizes) == shape:
        return
    if not shape:  # a scalar in two non-empty chunks
        raise CorruptCheckpointError(f"{_chunk(fqn, *full[1])} overlaps chunk {full[0][0]}")
    spans = [d for d in range(len(shape)) if any(c.sizes[d] != shape[d] for _, c in full)]
    if len(spans) == 1:  # slices along one dim (Shard(d) on one mesh axis): in order, end to end
        (d,) = spans
        end, prev = 0, None
        for i, c in sorted(full, key=lambda ic: ic[1].offsets[d]):
            if c.offsets[d] != end:
                if c.offsets[d] < end:
                    raise CorruptCheckpointError(f"{_chunk(fqn, i, c)} overlaps chunk {prev}")
                raise CorruptCheckpointError(_uncovered(fqn, shape, [0] * d + [end] + [0] * (len(shape) - d - 1)))
            end, prev = c.offsets[d] + c.sizes[d], i
        if end != shape[d]:
            raise CorruptCheckpointError(_uncovered(fqn, shape, [0] * d + [end] + [0] * (len(shape) - d - 1)))
        return
    _grid(fqn, shape, full)


def _uncovered(fqn: str, shape: list[int], element: list[int]) -> str:
    return (f"tensor {fqn!r} of shape {shape}: element {element} is in no chunk; its chunks do not "
            "cover the tensor (a chunk missing)")


def _grid(fqn: str, shape: list[int], full: list[tuple[int, ChunkMeta]]) -> None:
    bounds = [sorted({0, n, *(c.offsets[d] for _, c in full), *(c.offsets[d] + c.sizes[d] for _, c in full)})
              for d, n in enumerate(shape)]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > _GRID_CELLS:
        _pairwise(fqn, shape, full)
        return
    # a regular grid (Shard on several dims, any sizes): each chunk is one cell, one chunk a cell
    cell_of: dict[tuple[int, ...], int] = {}
    for i, c in full:
        lo = tuple(bisect.bisect_left(b, o) for b, o in zip(bounds, c.offsets))
        if any(b[j + 1] != o + s for b, j, o, s in zip(bounds, lo, c.offsets, c.sizes)):
            break  # spans several cells: mark them below
        j = cell_of.setdefault(lo, i)
        if j != i:
            raise CorruptCheckpointError(f"{_chunk(fqn, i, c)} overlaps chunk {j}")
    else:
        if len(cell_of) != cells:
            hole = next(j for j in itertools.product(*(range(len(b) - 1) for b in bounds)) if j not in cell_of)
            raise CorruptCheckpointError(_uncovered(fqn, shape, [bounds[d][j] for d, j in enumerate(hole)]))
        return
    owner = np.full([len(b) - 1 for b in bounds], -1, dtype=np.int64)  # chunk index per cell
    for i, c in full:
        box = tuple(slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + s))
                    for b, o, s in zip(bounds, c.offsets, c.sizes))
        cell = owner[box]
        taken = cell[cell >= 0]
        if taken.size:
            raise CorruptCheckpointError(f"{_chunk(fqn, i, c)} overlaps chunk {int(taken[0])}")
        cell[...] = i
    hole = np.argwhere(owner < 0)
    if hole.size:
        raise CorruptCheckpointError(_uncovered(fqn, shape, [bounds[d][j] for d, j in enumerate(hole[0])]))


def _pairwise(fqn: str, shape: list[int], full: list[tuple[int, ChunkMeta]]) -> None:
    """No two chunks overlap (each against the later ones, vectorised) and their volumes sum
    to the tensor's: then they cover it exactly."""
    lo = np.array([c.offsets for _, c in full], dtype=np.int64)  # (n, ndim)
    hi = lo + np.array([c.sizes for _, c in full], dtype=np.int64)
    for k, (i, _) in enumerate(full[:-1]):
        hit = np.flatnonzero(np.all((lo[k + 1:] < hi[k]) & (lo[k] < hi[k + 1:]), axis=1))
        if hit.size:
            raise CorruptCheckpointError(f"{_chunk(fqn, *full[k + 1 + int(hit[0])])} overlaps chunk {i}")
    covered = sum(math.prod(c.sizes) for _, c in full)
    if covered != math.prod(shape):
        raise CorruptCheckpointError(f"tensor {fqn!r} of shape {shape}: its chunks cover {covered} of "
                                     f"{math.prod(shape)} elements (a chunk missing)")


def _value(fqn: str, stored: Any) -> None:
    if isinstance(stored, dict) and len(stored) == 1 and "$raw" in stored:
        try:
            base64.b64decode(stored["$raw"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise CorruptCheckpointError(f"value {fqn!r}: its raw bytes are not base64") from None
        return
    try:
        values_mod.decode(stored)
    except (ValueError, TypeError, RuntimeError, OverflowError, RecursionError) as e:
        raise CorruptCheckpointError(f"value {fqn!r} does not decode ({type(e).__name__}: {str(e)[:120]})") from None
