"""Plans, results and metadata between ranks as JSON, not pickle.

    to_wire(SavePlan([WriteItem(MetadataIndex("w", (0,)), ...)])) -> JSON-able tree
    from_wire(to_wire(x)) == x      (dataclasses, enums, torch.Size/dtype/layout/memory_format,
                                     tuples, dicts with any hashable keys, primitives)

torch's DCP moves plans with all_gather_object (pickle). plait's checkpoint runs no
pickle (group.py); a planner's or storage layer's own `planner_data` / `storage_data`
travels as long as it is built of the above. A dataclass is rebuilt from its
module:qualname, and only a dataclass is: decoding imports nothing else and runs no code
beyond the dataclass's own __init__.
"""

from __future__ import annotations

import dataclasses
import importlib
from enum import Enum
from typing import Any

import torch

_MEMORY_FORMATS = {str(f): f for f in (torch.contiguous_format, torch.channels_last, torch.preserve_format,
                                       torch.channels_last_3d)}
_LAYOUTS = {str(x): x for x in (torch.strided, torch.sparse_coo, torch.sparse_csr)}


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _lookup(name: str) -> type:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def to_wire(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
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
        fields = {f.name: to_wire(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init or f.name == "index"}
        return {"$dc": _type_name(type(x)), "fields": fields}
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


def from_wire(x: Any) -> Any:
    if isinstance(x, list):
        return [from_wire(v) for v in x]
    if not isinstance(x, dict):
        return x
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
    if "$dc" in x:
        cls = _lookup(x["$dc"])
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"checkpoint plan names {x['$dc']!r}, which is not a dataclass")
        return cls(**{k: from_wire(v) for k, v in x["fields"].items()})
    if "$tuple" in x:
        return tuple(from_wire(v) for v in x["$tuple"])
    if "$dict" in x:
        return {from_wire(k): from_wire(v) for k, v in x["$dict"]}
    if "$bytes" in x:
        return bytes.fromhex(x["$bytes"])
    raise ValueError(f"malformed checkpoint plan entry {x!r:.80}")
