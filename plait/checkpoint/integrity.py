"""What a corrupt checkpoint's error says: which checkpoint, and which one to fall back to.

    a check fails (metadata.py: metadata.json's own crc32; safetensors_io.py: a file's size,
    its header's crc32, a chunk's crc32) -> CorruptCheckpointError(detail naming the file and
    tensor) -> describe(path, detail): "checkpoint PATH is corrupt: detail; the previous
    complete checkpoint in PARENT is step-000100"

"Complete" is the commit's word (commit.status: metadata.json committed), the same test
plait.train uses to pick the checkpoint to resume from. "Previous" is by the number in the
name: among the siblings named like this one (step-000150 -> step-NNNNNN), the complete one
with the highest number below this one's. A name without a number has no previous; the
message then says nothing of one rather than guess from file times.
"""

from __future__ import annotations

import os
import re

from plait.checkpoint import commit

_NUMBERS = re.compile(r"(\d+)")


def _split(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """"step-000150" -> (("step-", ""), (150,)): the name's shape and its numbers."""
    parts = _NUMBERS.split(name)
    return tuple(parts[0::2]), tuple(int(n) for n in parts[1::2])


def previous_complete(path: str | os.PathLike) -> str | None:
    """The complete checkpoint beside `path` with the highest number below its, or None."""
    path = os.path.normpath(os.fspath(path))
    parent, name = os.path.split(path)
    shape, numbers = _split(name)
    if not numbers:
        return None
    best: tuple[tuple[int, ...], str] | None = None
    try:
        entries = list(os.scandir(parent or "."))
    except OSError:
        return None
    for entry in entries:
        s, n = _split(entry.name)
        if s == shape and n < numbers and (best is None or n > best[0]) and entry.is_dir():
            if commit.status(os.path.join(parent, entry.name)) is None:
                best = (n, os.path.join(parent, entry.name))
    return None if best is None else best[1]


def fallback(path: str | os.PathLike) -> str:
    """The sentence that names the previous complete checkpoint ("" if none is known)."""
    path = os.path.normpath(os.fspath(path))
    parent = os.path.dirname(path) or "."
    if not _split(os.path.basename(path))[1]:
        return ""
    prev = previous_complete(path)
    if prev is None:
        return f"; there is no earlier complete checkpoint in {parent}"
    return (f"; the previous complete checkpoint in {parent} is {os.path.basename(prev)} "
            f"(check it with `plait checkpoint verify {prev}`)")


def describe(path: str | os.PathLike, detail: str) -> str:
    """The message of a corrupt checkpoint at `path`: what is wrong and what to load instead."""
    path = os.path.normpath(os.fspath(path))
    return f"checkpoint {path} is corrupt: {detail}{fallback(path)}"
