"""Plans, results and metadata between ranks as JSON, not pickle.

    to_wire(SavePlan([WriteItem(MetadataIndex("w", (0,)), ...)])) -> JSON-able tree
    from_wire(to_wire(x)) == x      (dataclasses, enums, torch.Size/dtype/layout/memory_format,
                                     tuples, dicts with any hashable keys, primitives)
    tagged: {"$size": [...]}, {"$dc": "module:Class", "fields": {...}}, ... (the first key
    starts with "$"); a dict of str keys none of which starts with "$" goes as itself

torch's DCP moves plans with all_gather_object (pickle). plait's checkpoint runs no
pickle (group.py); a planner's or storage layer's own `planner_data` / `storage_data`
travels as long as it is built of the above. A dataclass is rebuilt from its
module:qualname, and only a dataclass is: decoding imports nothing else and runs no code
beyond the dataclass's own __init__.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from enum import Enum
from typing import Any

import torch

from plait.checkpoint.planner_api import (
    ChunkStorageMetadata,
    LoadItemType,
    MetadataIndex,
    ReadItem,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from plait.checkpoint.storage_api import WriteResult

_MEMORY_FORMATS = {str(f): f for f in (torch.contiguous_format, torch.channels_last, torch.preserve_format,
                                       torch.channels_last_3d)}
_LAYOUTS = {str(x): x for x in (torch.strided, torch.sparse_coo, torch.sparse_csr)}


@functools.cache
def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


@functools.cache
def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init or f.name == "index")


_PLAIN = frozenset({type(None), bool, int, float, str})


@functools.cache
def _lookup(name: str) -> type:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _write_item(x: WriteItem) -> dict[str, Any] | None:
    """A WriteItem of the plain parts (every item the built-in planner makes) as one flat
    list: a plan holds one per chunk, and the generic form costs ~15 tagged objects each.
    None: some part is not the plain type (a subclass, a tuple for a Size): generic form."""
    idx, td = x.index, x.tensor_data
    if type(idx) is not MetadataIndex or x.bytes_io_data is not None or type(x.type) is not WriteItemType:
        return None
    tensor = None
    if td is not None:
        if not (type(td) is TensorWriteData and type(td.chunk) is ChunkStorageMetadata
                and type(td.properties) is TensorProperties and type(td.size) is torch.Size
                and type(td.chunk.offsets) is torch.Size and type(td.chunk.sizes) is torch.Size
                and type(td.properties.dtype) is torch.dtype):
            return None
        p = td.properties
        tensor = [list(td.chunk.offsets), list(td.chunk.sizes), list(td.size), str(p.dtype).removeprefix("torch."),
                  str(p.layout), p.requires_grad, str(p.memory_format), p.pin_memory]
    return {"$wi": [idx.fqn, None if idx.offset is None else list(idx.offset), idx.index, x.type.name, tensor]}


def _from_write_item(fqn, offset, index, kind, tensor) -> WriteItem:
    td = None
    if tensor is not None:
        offsets, sizes, size, dtype, layout, requires_grad, memory_format, pin = tensor
        td = TensorWriteData(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                             TensorProperties(getattr(torch, dtype), _LAYOUTS[layout], requires_grad,
                                              _MEMORY_FORMATS[memory_format], pin), torch.Size(size))
    return WriteItem(MetadataIndex(fqn, offset, index), WriteItemType[kind], tensor_data=td)


def _index(i: Any) -> list | None:
    if type(i) is not MetadataIndex or not (i.offset is None or type(i.offset) is torch.Size):
        return None
    return [i.fqn, None if i.offset is None else list(i.offset), i.index]


def _read_item(x: ReadItem) -> dict[str, Any] | None:
    """A ReadItem of the plain parts as one flat list (a load plan holds one per box)."""
    dest, storage = _index(x.dest_index), _index(x.storage_index)
    boxes = (x.dest_offsets, x.storage_offsets, x.lengths)
    if dest is None or storage is None or type(x.type) is not LoadItemType or any(type(b) is not torch.Size
                                                                                   for b in boxes):
        return None
    return {"$ri": [x.type.name, dest, storage, *(list(b) for b in boxes)]}


def _from_read_item(kind, dest, storage, dest_offsets, storage_offsets, lengths) -> ReadItem:
    return ReadItem(LoadItemType[kind], MetadataIndex(*dest), torch.Size(dest_offsets), MetadataIndex(*storage),
                    torch.Size(storage_offsets), torch.Size(lengths))


def _json_tree(x: Any) -> bool:
    """x travels as itself: str-keyed dicts (no key starting with "$"), lists and primitives."""
    t = type(x)
    if t in _PLAIN:
        return True
    if t is list:
        return all(_json_tree(v) for v in x)
    return t is dict and all(type(k) is str and not k.startswith("$") and _json_tree(v) for k, v in x.items())


def _write_result(x: WriteResult) -> dict[str, Any] | None:
    """A WriteResult whose storage_data is plain JSON (the built-in writer's chunk and file
    records) as one flat list: the coordinator decodes every rank's, one per chunk, and the
    generic form walks each record key by key."""
    idx = x.index
    if (type(idx) is not MetadataIndex or type(x.size_in_bytes) is not int or not (
            idx.offset is None or type(idx.offset) is torch.Size) or not _json_tree(x.storage_data)):
        return None
    return {"$wr": [idx.fqn, None if idx.offset is None else list(idx.offset), idx.index, x.size_in_bytes,
                    x.storage_data]}


def to_wire(x: Any) -> Any:
    t = type(x)
    if t in _PLAIN:
        return x
    if t is WriteItem or t is ReadItem or t is WriteResult:
        enc = _write_item(x) if t is WriteItem else _read_item(x) if t is ReadItem else _write_result(x)
        if enc is not None:
            return enc
    if t is list:
        return [to_wire(v) for v in x]
    if t is torch.Size:
        return {"$size": list(x)}
    if t is dict and all(type(k) is str and not k.startswith("$") for k in x):
        return {k: to_wire(v) for k, v in x.items()}  # a JSON object as is: tags all start with "$"
    if t in _FIELDS_OF:
        return {"$dc": _type_name(t), "fields": {n: to_wire(getattr(x, n)) for n in _FIELDS_OF[t]}}
    if isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Size):
        return {"$size": list(x)}
    if isinstance(x, torch.dtype):
        return {"$dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.layout):
        return {"$layout": str(x)}
    if isinstance(x, torch.memory_format):
        return {"$memory_format": str(x)}
    if isinstance(x, Enum):
        return {"$enum": _type_name(type(x)), "name": x.name}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        _FIELDS_OF[t] = _fields(t)  # the next one of this class takes the fast path above
        return {"$dc": _type_name(t), "fields": {n: to_wire(getattr(x, n)) for n in _FIELDS_OF[t]}}
    if isinstance(x, tuple):
        return {"$tuple": [to_wire(v) for v in x]}
    if isinstance(x, list):
        return [to_wire(v) for v in x]
    if isinstance(x, dict):
        return {"$dict": [[to_wire(k), to_wire(v)] for k, v in x.items()]}
    if isinstance(x, bytes):
        return {"$bytes": x.hex()}
    raise TypeError(f"a checkpoint plan holds a {type(x).__qualname__} ({x!r:.80}), which plait sends between "
                    "ranks as JSON, not pickle: planner_data/storage_data must be built of dataclasses, "
                    "enums, lists, tuples, dicts, str/int/float/bool/None and torch.Size/dtype")


_FIELDS_OF: dict[type, tuple[str, ...]] = {}  # dataclasses met so far: their fields


def from_wire(x: Any) -> Any:
    t = type(x)
    if t is list:
        return [from_wire(v) for v in x]
    if t is not dict:
        return x
    first = next(iter(x), "")
    if not first.startswith("$"):
        return {k: from_wire(v) for k, v in x.items()}
    if first == "$wi":
        return _from_write_item(*x["$wi"])
    if first == "$ri":
        return _from_read_item(*x["$ri"])
    if first == "$wr":
        fqn, offset, index, size, storage_data = x["$wr"]
        return WriteResult(MetadataIndex(fqn, offset, index), size, storage_data)
    if "$dc" in x:
        cls = _lookup(x["$dc"])
        if cls not in _FIELDS_OF and not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"checkpoint plan names {x['$dc']!r}, which is not a dataclass")
        return cls(**{k: from_wire(v) for k, v in x["fields"].items()})
    if "$size" in x:
        return torch.Size(x["$size"])
    if "$dtype" in x:
        return getattr(torch, x["$dtype"])
    if "$layout" in x:
        return _LAYOUTS[x["$layout"]]
    if "$memory_format" in x:
        return _MEMORY_FORMATS[x["$memory_format"]]
    if "$enum" in x:
        cls = _lookup(x["$enum"])
        if not (isinstance(cls, type) and issubclass(cls, Enum)):
            raise ValueError(f"checkpoint plan names {x['$enum']!r}, which is not an Enum")
        return cls[x["name"]]
    if "$tuple" in x:
        return tuple(from_wire(v) for v in x["$tuple"])
    if "$dict" in x:
        return {from_wire(k): from_wire(v) for k, v in x["$dict"]}
    if "$bytes" in x:
        return bytes.fromhex(x["$bytes"])
    raise ValueError(f"malformed checkpoint plan entry {x!r:.80}")
