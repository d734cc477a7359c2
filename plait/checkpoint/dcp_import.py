"""import-torch-dcp: convert a checkpoint written by torch.distributed.checkpoint, safely.

    DIR/.metadata (a pickle) --restricted unpickler--> records: fqn -> dtype, size, chunks;
        (fqn, chunk offsets) -> (file, offset, length)
    DIR/__R_T.distcp byte ranges --torch.load(weights_only=True) or raw bytes--> chunk tensors
    -> one safetensors file + metadata.json in OUT, committed atomically like a save

The unpickler admits only the names DCP's metadata pickles (its dataclasses, torch dtypes,
torch.Size, the layout helper, pathlib paths), each mapped to an inert stand-in built here,
and refuses any other global with an error naming it, so a crafted .metadata cannot run
code. Every file an entry names is a plain name in DIR, a regular file (confine.py), and
its byte range lies inside it; the chunks must tile their tensors (validate.py) before the
result is committed. DCP's own classes are not imported (plait does not depend on torch's DCP).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil
from dataclasses import asdict
from typing import Any

import torch

from plait.checkpoint import commit, validate, values
from plait.checkpoint.confine import check_name, open_regular
from plait.checkpoint.metadata import ChunkMeta, Metadata, TensorMeta, dtype_name
from plait.checkpoint.safetensors_io import write_file
from plait.checkpoint.storage import chunk_name

_DCP_META = "torch.distributed.checkpoint.metadata"
_RECORDS = {(_DCP_META, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                     "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                     "StorageMeta")}
_RECORDS.add(("torch.distributed.checkpoint.filesystem", "_StorageInfo"))


class Record:
    """An inert stand-in for one DCP metadata object: its pickled state, nothing else."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and (
                state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) form of slotted dataclasses
        self.state = state

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state")
        if isinstance(state, dict) and not name.startswith("__"):
            return state.get(name)  # a field left at its dataclass default (None) is not pickled
        raise AttributeError(name)

    def __hash__(self) -> int:  # MetadataIndex is a dict key
        return id(self)


def _record_class(name: str) -> type:
    return type(name, (Record,), {})


class RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, *, where: str) -> None:
        super().__init__(file)
        self.where = where
        self.classes: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _RECORDS:
            return self.classes.setdefault(key, _record_class(name))
        if key == (_DCP_META, "_MEM_FORMAT_ENCODING"):
            return lambda v: v
        if key == ("torch.serialization", "_get_layout"):
            return lambda s: s
        if key == ("torch", "Size"):
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            return lambda *parts: os.path.join(*parts) if parts else ""
        if key == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(
            f"refusing {module}.{name} in {self.where}: a torch DCP .metadata holds only DCP's metadata "
            "classes, torch dtypes and torch.Size; this file names something else, which unpickling "
            "could use to run code")


def read_dcp_metadata(directory: str) -> Any:
    where = os.path.join(directory, ".metadata")
    with open_regular(where, what="the torch DCP metadata") as f:
        return RestrictedUnpickler(f, where=where).load()


def _index_key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    offset = index.offset
    return index.fqn, (None if offset is None else tuple(offset))


def _load_item(raw: bytes, *, what: str) -> Any:
    if raw[:2] == b"PK":  # torch.save's zip format
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    raise ValueError(f"{what} is not in torch.save format and has no raw-bytes description")


def _entry(fqn: str, entry: Any, raw, tensors: dict, vals: dict, pieces: list, *, where: str) -> None:
    """One state_dict_metadata entry: a value into `vals`, a tensor into `tensors` and its
    non-empty chunks (read through `raw`) into `pieces`."""
    if type(entry).__name__ == "BytesStorageMetadata":
        vals[fqn] = values.encode(_load_item(raw(fqn, None), what=f"value {fqn!r}"), key=fqn)
        return
    props = entry.properties.state  # TensorProperties pickles (dtype, layout, ...) as a tuple
    dtype = props[0] if isinstance(props, tuple) else props["dtype"]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where} gives {fqn!r} the dtype {dtype!r}")
    size = tuple(entry.size)
    tensors[fqn] = TensorMeta(list(size), dtype_name(dtype), {"placements": [], "from": "torch DCP"})
    for c in entry.chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if any(type(x) is not int or x < 0 for x in (*offsets, *sizes)) or not len(offsets) == len(sizes) == len(size):
            raise ValueError(f"{where}: a chunk of {fqn!r} {list(size)} has offsets {list(offsets)}, sizes {list(sizes)}")
        data = raw(fqn, offsets)
        if data[:2] == b"PK":
            t = _load_item(data, what=f"tensor {fqn!r}")
        elif len(data) == math.prod(sizes) * dtype.itemsize:  # raw bytes of the chunk
            t = torch.frombuffer(bytearray(data), dtype=dtype).view(sizes)
        else:
            raise ValueError(f"DCP chunk of {fqn!r} at {list(offsets)} is {len(data)} bytes; {dtype}"
                             f"{list(sizes)} is {math.prod(sizes) * dtype.itemsize}")
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != sizes or t.dtype != dtype:
            raise ValueError(f"DCP chunk of {fqn!r} at {list(offsets)} is {getattr(t, 'dtype', type(t).__name__)}"
                             f"{list(getattr(t, 'shape', []))}, its metadata says {dtype}{list(sizes)}")
        if math.prod(sizes):
            pieces.append((fqn, offsets, sizes, t))


def import_torch_dcp(directory: str, out: str) -> dict[str, Any]:
    """Convert DIR into a plait checkpoint OUT; returns {"tensors": n, "values": n}."""
    md = read_dcp_metadata(directory)
    try:
        storage = {_index_key(k): v for k, v in md.storage_data.items()}
        entries = dict(md.state_dict_metadata.items())
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{directory}/.metadata is not a torch DCP Metadata ({type(e).__name__}: {e})") from None
    opened: dict[str, Any] = {}

    def raw(fqn: str, offset: tuple[int, ...] | None) -> bytes:
        info = storage.get((fqn, offset))
        what = f"{directory}/.metadata's storage entry for {fqn!r} at offsets {offset}"
        if info is None:
            raise ValueError(f"{directory}/.metadata has no storage entry for {fqn!r} at offsets {offset}")
        name = check_name(info.relative_path, what=what)  # never a file outside DIR
        path = os.path.join(directory, name)
        if name not in opened:
            opened[name] = open_regular(path, what=what)
        f = opened[name]
        begin, length = info.offset, info.length
        size = os.fstat(f.fileno()).st_size
        if type(begin) is not int or type(length) is not int or begin < 0 or length < 0 or begin + length > size:
            raise ValueError(f"{what} gives bytes [{begin!r}, +{length!r}) of {path}, which has {size} bytes")
        f.seek(begin)
        data = f.read(length)
        if len(data) != length:
            raise ValueError(f"{path} is truncated: {fqn!r} needs bytes [{begin}, {begin + length})")
        return data

    staging = commit.begin(out, overwrite=False)
    tensors: dict[str, TensorMeta] = {}
    vals: dict[str, Any] = {}
    pieces: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []
    try:
        for fqn, entry in entries.items():
            try:
                _entry(fqn, entry, raw, tensors, vals, pieces, where=f"{directory}/.metadata")
            except (TypeError, AttributeError, KeyError, IndexError) as e:  # a crafted record's fields
                raise ValueError(f"{directory}/.metadata: the entry of {fqn!r} is malformed "
                                 f"({type(e).__name__}: {e})") from None
        file = "__0_0.safetensors"
        written = write_file(os.path.join(staging, file), [(chunk_name(f, o), t) for f, o, _, t in pieces], sync=True)
        for (fqn, offsets, sizes, _), (name, begin, nbytes, crc) in zip(pieces, written):
            tensors[fqn].chunks.append(ChunkMeta(list(offsets), list(sizes), file, name, begin, nbytes, crc))
        # what load and verify will check, before it is committed: the chunks tile their tensors
        validate.check(Metadata(tensors, vals, 1, [file], {file: written.file_meta}), where=f"{directory}/.metadata")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for f in opened.values():
            f.close()
    chunks = {fqn: [vars(c) for c in t.chunks] for fqn, t in tensors.items() if t.chunks}
    metas = {fqn: {"shape": t.shape, "dtype": t.dtype, "layout": t.layout} for fqn, t in tensors.items()}
    commit.write_fragment(staging, 0, {"rank": 0, "tensors": metas, "chunks": chunks, "values": vals, "files": [file],
                                       "file_meta": {file: asdict(written.file_meta)}, "error": None}, sync=True)
    commit.finish(out, 1, sync=True, timeout=1.0)
    return {"tensors": len(tensors), "values": len(vals)}
