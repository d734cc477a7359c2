"""Where an op came from: the innermost frame of the caller's stack that is user code.

    comm.all_reduce <- plait/ddp/reducer.py (hook) <- torch/autograd <- train.py:42 loss.backward()
    call_site() -> ("train.py", 42, "main")

"User code" is everything but plait's library layers, torch, the code torch generates (FX
graphs, Inductor's kernel files: a compiled graph's collectives run there) and the
standard library, so
a collective issued by DDP's hook, a DTensor op or torch's `all_gather_object` is placed
at the script line that caused it. Frames are classified once per code object (one dict
lookup per frame afterwards): the default flight recorder takes a call site for every op.
The lookup is by the code object's id, not the code object: CPython does not cache a code
object's hash but recomputes it from its bytecode, names and constants on every lookup,
which over the ~9 frames between a pipeline's p2p op and the user's line cost 20-30 µs
per op on the caches a training step leaves (measured: benchmarks' per-action overhead).
Each entry keeps its code object, so an id in the table cannot be reused by another.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import traceback
from types import CodeType, FrameType

Site = tuple[str, int, str]  # (file, line, function)

_PLAIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# plait's layers are library code; plait/train and plait/demo are scripts, like a user's
_LIBRARY = tuple(os.path.join(_PLAIT, name) for name in (
    "comm", "debug", "tensor", "ddp", "fsdp", "pipelining", "device_mesh", "checkpoint", "testing",
))
_torch_spec = importlib.util.find_spec("torch")  # torch's folder, without importing torch
_TORCH = os.path.dirname(os.path.abspath(_torch_spec.origin)) if _torch_spec and _torch_spec.origin else "<no torch>"

_STDLIB = os.path.dirname(os.path.abspath(os.__file__))
_OURS = tuple(os.path.join(_PLAIT, name) for name in ("comm", "debug"))

# code torch generates: frozen modules, FX graphs (a compiled graph's collectives run in one)
# and Inductor's kernels file, which lives under its cache folder, torchinductor_<user>
_GENERATED = ("<frozen", "<eval_with_key")
_INDUCTOR_CODE = f"{os.sep}torchinductor_"

_internal: dict[int, tuple[CodeType, bool]] = {}  # id(code) -> (code, is library code)


def _is_internal(code: CodeType) -> bool:
    found = _internal.get(id(code))
    if found is not None and found[0] is code:
        return found[1]
    name = code.co_filename
    known = (
        name.startswith(_LIBRARY) or name.startswith(_TORCH) or name.startswith(_GENERATED)
        or _INDUCTOR_CODE in name
        or (name.startswith(_STDLIB) and "-packages" not in name)
    )
    _internal[id(code)] = (code, known)
    return known


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost user frame at or above `frame`; else the innermost frame outside
    plait.comm and plait.debug (the library line that issued the op)."""
    start = frame
    internal = _internal
    while frame is not None:
        code = frame.f_code
        found = internal.get(id(code))  # the cache inline: one lookup per frame, no call
        if not (found[1] if found is not None and found[0] is code else _is_internal(code)):
            return frame
        frame = frame.f_back
    frame = start  # no user frame (rare): walk again for the fallback
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame = frame.f_back
    return frame


def call_site(skip: int = 1) -> Site | None:
    """The user line that issued the current op (`skip` frames above the caller)."""
    frame = user_frame(sys._getframe(skip + 1))
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def stack(skip: int = 1, limit: int = 48) -> list[Site]:
    """The current Python stack, innermost first, without plait.comm/plait.debug frames."""
    frames: list[Site] = []
    frame: FrameType | None = sys._getframe(skip + 1)
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        if not code.co_filename.startswith(_OURS):
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return frames


def short_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def format_site(site: Site | list | tuple | None) -> str:
    if not site:
        return "<unknown>"
    path, line, func = site
    return f"{short_path(path)}:{line} in {func}"


def format_stack(frames: list[Site] | list[list]) -> str:
    """Traceback-style text, outermost first, from an innermost-first list of sites."""
    summary = traceback.StackSummary.from_list([(p, ln, fn, None) for p, ln, fn in reversed(frames)])
    return "".join(summary.format())


def format_frames(frame: FrameType | None, limit: int = 40) -> str:
    """Traceback-style text of a live stack, outermost first, without the frames of
    plait.comm and plait.debug (a reader wants the line that called the op, not our door)."""
    if frame is None:
        return ""
    kept = [(f, line) for f, line in traceback.walk_stack(frame) if not f.f_code.co_filename.startswith(_OURS)]
    return "".join(traceback.StackSummary.extract(reversed(kept[:limit])).format())


def thread_stacks(limit: int = 40) -> dict[str, dict]:
    """Every thread's current Python stack: name -> {"where": user line, "stack": text}."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out: dict[str, dict] = {}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            frame = frame.f_back  # not this function itself
        name = names.get(ident, f"thread-{ident}")
        if name.startswith("plait-debug"):
            continue  # our own watchdog and dumper threads
        user = user_frame(frame)
        out[name] = {
            "where": None if user is None else format_site(
                (user.f_code.co_filename, user.f_lineno, user.f_code.co_name)),
            "stack": format_frames(frame, limit),
        }
    return out
