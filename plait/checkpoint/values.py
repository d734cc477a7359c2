"""Non-tensor values as JSON, exactly: what JSON cannot hold is type-tagged, nothing is pickled.

    encode(3) -> 3                         encode((1, None)) -> {"$tuple": [1, None]}
    encode({"lr": 0.1}) -> {"$dict": [["lr", 0.1]]}   encode(float("nan")) -> {"$float": "nan"}
    decode(encode(v)) == v and type-for-type equal (tuple stays tuple, int stays int, ...)

Every dict is tagged, so a JSON object in the encoding is always a tag and never ambiguous
with user data. A value of any other type is refused with the key that holds it: the
checkpoint must load without running code, so it cannot store an arbitrary object.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)}


def encode(value: Any, *, key: str) -> Any:
    """JSON-able form of `value`; TypeError naming `key` for what cannot be stored safely."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if type(value) is int else {"$int": int(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": repr(value)}  # 'nan', 'inf', '-inf'
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, key=f"{key}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, key=f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {"$dict": [[encode(k, key=f"{key} (a key)"), encode(v, key=f"{key}.{k}")] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    raise TypeError(
        f"state_dict[{key!r}] holds a {type(value).__module__}.{type(value).__qualname__}, which a "
        "plait checkpoint cannot store: it keeps tensors, None/bool/int/float/str and lists, tuples "
        "and dicts of them (no pickle, so loading runs no code). Convert it, or give its owner "
        "state_dict()/load_state_dict() returning such values (Stateful)"
    )


def decode(data: Any) -> Any:
    """The value `encode` was given."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise ValueError(f"malformed value in checkpoint metadata: {data!r}")
    tag, body = next(iter(data.items()))
    if tag == "$tuple":
        return tuple(decode(v) for v in body)
    if tag == "$dict":
        return {decode(k): decode(v) for k, v in body}
    if tag == "$float":
        return float(body)
    if tag == "$int":
        return int(body)
    if tag == "$size":
        return torch.Size(body)
    if tag == "$bytes":
        return base64.b64decode(body)
    if tag == "$dtype":
        if body not in _DTYPES:
            raise ValueError(f"unknown dtype {body!r} in checkpoint metadata")
        return _DTYPES[body]
    if tag == "$device":
        return torch.device(body)
    raise ValueError(f"unknown value tag {tag!r} in checkpoint metadata")
