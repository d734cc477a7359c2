"""torch's format_utils: a plait checkpoint <-> one `torch.save` file, in one process.

    dcp_to_torch_save(DIR, FILE):  DIR's metadata.json -> an empty state dict of every saved key
        (full-size tensors, value placeholders) -> load(no_dist=True) through the checked path
        (every checksum verified) -> torch.save({fqn: full tensor or value}, FILE)
    torch_save_to_dcp(FILE, DIR):  torch.load(FILE, weights_only=True) -> save(no_dist=True) into DIR

Safety: torch's torch_save_to_dcp unpickles with weights_only=False, which runs whatever code
the file names; here the file is read only with weights_only=True (tensors, containers and
plain Python values), so a file holding any other class is refused with the error torch gives,
naming the class. A plait checkpoint holds no pickle to begin with.

One difference from torch, stated: torch's DCP metadata records each key's path in the nested
state dict (planner_data) and dcp_to_torch_save rebuilds the nesting from it; plait's
metadata records the keys joined with "." only, so the torch.save file holds the flat state
dict {"model.w": tensor, "step": 5, ...}. Saved back with torch_save_to_dcp it gives the same
keys, so DIR -> FILE -> DIR round trips. Both hold the whole state in memory (as torch's
warn): run them on one rank.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from plait.checkpoint.loader import load
from plait.checkpoint.metadata import dtype_from_name
from plait.checkpoint.saver import save
from plait.checkpoint.storage import FileSystemReader, FileSystemWriter


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike) -> None:
    """Convert the plait checkpoint in `dcp_checkpoint_dir` into one torch.save file (the flat
    state dict: full tensors and values by their saved keys)."""
    reader = FileSystemReader(dcp_checkpoint_dir)
    md = reader.read_metadata()
    state: dict[str, Any] = {fqn: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for fqn, t in md.tensors.items()}
    state.update(dict.fromkeys(md.values))  # placeholders: load assigns each saved value by its key
    load(state, storage_reader=reader, no_dist=True)
    torch.save(state, torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike) -> None:
    """Convert a torch.save file holding a state dict (tensors and plain values) into a plait
    checkpoint in `dcp_checkpoint_dir`. The file is read with weights_only=True only."""
    try:
        state = torch.load(torch_save_path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"torch_save_to_dcp: {os.fspath(torch_save_path)} holds more than tensors and plain "
                         f"values, and plait reads torch.save files only with weights_only=True (never "
                         f"unpickling arbitrary objects, which could run code). Re-save it holding only "
                         f"tensors, containers and numbers/strings. torch.load said: {e}") from None
    if not isinstance(state, dict):
        raise TypeError(f"torch_save_to_dcp: {os.fspath(torch_save_path)} holds a {type(state).__name__}, "
                        "not a state dict (a dict)")
    save(state, storage_writer=FileSystemWriter(dcp_checkpoint_dir), no_dist=True)
