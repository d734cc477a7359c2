"""Non-tensor values as JSON, exactly: what JSON cannot hold is type-tagged, nothing is pickled.

    encode(3) -> 3                         encode((1, None)) -> {"$tuple": [1, None]}
    encode({"lr": 0.1}) -> {"$dict": [["lr", 0.1]]}   encode(float("nan")) -> {"$float": "nan"}
    decode(encode(v)) == v and type-for-type equal (tuple stays tuple, int stays int, ...)

Every dict is tagged, so a JSON object in the encoding is always a tag and never ambiguous
with user data. {"$raw": base64} is not a value's encoding: it holds the exact bytes a custom
SavePlanner's resolve_data gave for a BYTE_IO item (torch's DefaultSavePlanner gives
torch.save bytes); they are returned to a LoadPlanner's load_bytes unchanged, and plait
itself reads them only as torch.load(weights_only=True) does (load_raw). A value of any other type is refused with the key that holds it: the
checkpoint must load without running code, so it cannot store an arbitrary object.
"""

from __future__ import annotations

import base64
import io
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
    if tag == "$raw":
        return load_raw(base64.b64decode(body), key="(a value)")
    raise ValueError(f"unknown value tag {tag!r} in checkpoint metadata")


def raw(data: bytes) -> dict[str, str]:
    return {"$raw": base64.b64encode(data).decode("ascii")}


def raw_bytes(stored: Any) -> bytes | None:
    """The exact bytes of a stored {"$raw": ...} item; None for an encoded value."""
    if isinstance(stored, dict) and len(stored) == 1 and "$raw" in stored:
        return base64.b64decode(stored["$raw"])
    return None


def load_raw(data: bytes, *, key: str) -> Any:
    """Raw bytes as torch's DefaultLoadPlanner reads them, but with weights_only=True (tensors,
    primitives and their containers; no other object is unpickled, no code runs)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - every refusal gets the same advice
        raise ValueError(
            f"state_dict[{key!r}] was saved as {len(data)} raw bytes by a custom SavePlanner (torch's "
            "DefaultSavePlanner torch.saves non-tensor values); plait reads such bytes only with "
            f"torch.load(weights_only=True), which refused them ({type(e).__name__}: {str(e)[:160]}). "
            "Load it with a LoadPlanner whose load_bytes reads them: it receives the exact bytes saved"
        ) from None
