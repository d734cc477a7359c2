"""import-torch-dcp: convert a checkpoint written by torch.distributed.checkpoint, safely.

    DIR/.metadata (a pickle) --restricted unpickler--> records: fqn -> dtype, size, chunks;
        (fqn, chunk offsets) -> (file, offset, length)
    DIR/__R_T.distcp byte ranges --torch.load(weights_only=True) or raw bytes--> chunk tensors
    -> one safetensors file + metadata.json in OUT, committed atomically like a save

The unpickler admits only the names DCP's metadata pickles (its dataclasses, torch dtypes,
torch.Size, the layout helper, pathlib paths), each mapped to an inert stand-in built here,
and refuses any other global with an error naming it, so a crafted .metadata cannot run
code. DCP's own classes are not imported (plait does not depend on torch's DCP).
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import asdict
from typing import Any

import torch

from plait.checkpoint import commit, values
from plait.checkpoint.metadata import dtype_name
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
    with open(where, "rb") as f:
        return RestrictedUnpickler(f, where=where).load()


def _index_key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    offset = index.offset
    return index.fqn, (None if offset is None else tuple(offset))


def _load_item(raw: bytes, *, what: str) -> Any:
    if raw[:2] == b"PK":  # torch.save's zip format
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    raise ValueError(f"{what} is not in torch.save format and has no raw-bytes description")


def import_torch_dcp(directory: str, out: str) -> dict[str, Any]:
    """Convert DIR into a plait checkpoint OUT; returns {"tensors": n, "values": n}."""
    md = read_dcp_metadata(directory)
    storage = {_index_key(k): v for k, v in md.storage_data.items()}
    opened: dict[str, Any] = {}

    def raw(fqn: str, offset: tuple[int, ...] | None) -> bytes:
        info = storage.get((fqn, offset))
        if info is None:
            raise ValueError(f"{directory}/.metadata has no storage entry for {fqn!r} at offsets {offset}")
        path = os.path.join(directory, info.relative_path)
        if info.relative_path not in opened:
            opened[info.relative_path] = open(path, "rb")  # noqa: SIM115 - closed below
        f = opened[info.relative_path]
        f.seek(info.offset)
        data = f.read(info.length)
        if len(data) != info.length:
            raise ValueError(f"{path} is truncated: {fqn!r} needs bytes [{info.offset}, {info.offset + info.length})")
        return data

    staging = commit.begin(out, overwrite=False)
    tensors, chunks, vals, pieces = {}, {}, {}, []
    try:
        for fqn, entry in md.state_dict_metadata.items():
            if type(entry).__name__ == "BytesStorageMetadata":
                vals[fqn] = values.encode(_load_item(raw(fqn, None), what=f"value {fqn!r}"), key=fqn)
                continue
            props = entry.properties.state  # TensorProperties pickles (dtype, layout, ...) as a tuple
            dtype = props[0] if isinstance(props, tuple) else props["dtype"]
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{directory}/.metadata gives {fqn!r} the dtype {dtype!r}")
            size = tuple(entry.size)
            tensors[fqn] = {"shape": list(size), "dtype": dtype_name(dtype), "layout": {"placements": [], "from": "torch DCP"}}
            for c in entry.chunks:
                offsets, sizes = tuple(c.offsets), tuple(c.sizes)
                data = raw(fqn, offsets)
                if data[:2] == b"PK":
                    t = _load_item(data, what=f"tensor {fqn!r}")
                else:  # raw bytes of the chunk
                    t = torch.frombuffer(bytearray(data), dtype=dtype).view(sizes)
                if tuple(t.shape) != sizes or t.dtype != dtype:
                    raise ValueError(f"DCP chunk of {fqn!r} at {list(offsets)} is {t.dtype}{list(t.shape)}, "
                                     f"its metadata says {dtype}{list(sizes)}")
                if math.prod(sizes):
                    pieces.append((fqn, offsets, sizes, t))
        written = write_file(os.path.join(staging, "__0_0.safetensors"),
                             [(chunk_name(f, o), t) for f, o, _, t in pieces], sync=True)
        for (fqn, offsets, sizes, _), (name, begin, nbytes, crc) in zip(pieces, written):
            chunks.setdefault(fqn, []).append({"offsets": list(offsets), "sizes": list(sizes), "file": "__0_0.safetensors",
                                               "name": name, "begin": begin, "nbytes": nbytes, "crc32": crc})
    finally:
        for f in opened.values():
            f.close()
    commit.write_fragment(staging, 0, {"rank": 0, "tensors": tensors, "chunks": chunks, "values": vals,
                                       "files": ["__0_0.safetensors"],
                                       "file_meta": {"__0_0.safetensors": asdict(written.file_meta)}, "error": None}, sync=True)
    commit.finish(out, 1, sync=True, timeout=1.0)
    return {"tensors": len(tensors), "values": len(vals)}
