"""A small valid checkpoint to damage on purpose, and metadata.json rewritten with its checksum
recomputed (as whoever crafts one would: the crc32 detects a flipped bit, not an edit).

    w: float32 [8, 4] in two chunks (rows 0-3 and 4-7), s: bfloat16 [3], step: 5
"""

from __future__ import annotations

import json
import os

import torch

import plait.checkpoint as dcp
from plait.checkpoint.metadata import METADATA_FILE, crc32


def reference() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 4, generator=g), "s": torch.randn(3, generator=g).bfloat16(), "step": 5}


def empty(fill: float = 0.0) -> dict:
    return {"w": torch.full((8, 4), float(fill)), "s": torch.full((3,), float(fill), dtype=torch.bfloat16), "step": 0}


def read_body(path: str) -> dict:
    with open(os.path.join(path, METADATA_FILE)) as f:
        body = json.load(f)
    del body["metadata_crc32"]
    return body


def write_body(path: str, body: dict) -> None:
    """metadata.json as `body`, with a valid trailer: the checksum of the bytes before it."""
    head = json.dumps(body, indent=1)[:-2]  # without the closing "\n}"
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        f.write(f'{head},\n "metadata_crc32": "{crc32(head.encode()):08x}"\n}}\n')


def save(path: str) -> None:
    """reference() saved with w in two chunks: w's halves saved as two tensors, then named one."""
    ref = reference()
    dcp.save({"top": ref["w"][:4].clone(), "bottom": ref["w"][4:].clone(), "s": ref["s"], "step": ref["step"]},
             checkpoint_id=path)
    body = read_body(path)
    top, bottom = body["tensors"].pop("top"), body["tensors"].pop("bottom")
    bottom["chunks"][0]["offsets"] = [4, 0]
    body["tensors"]["w"] = {"shape": [8, 4], "dtype": "float32", "layout": {"placements": []},
                            "chunks": top["chunks"] + bottom["chunks"]}
    write_body(path, body)
