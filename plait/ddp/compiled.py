"""Data parallel under torch.compile: plait's bookkeeping runs eager, the user's module is
compiled in pieces at bucket boundaries, so each bucket's all-reduce overlaps the rest of
the compiled backward, as torch's DDP does under compile.

    torch.compile(DDP(model))(x)
      DDP.forward              skipped by dynamo (not traced): it reads the active compile
                               callback, then runs pre_forward / post_forward eager
      run(module, callback)    the callback's backend wrapped in dynamo's DDPOptimizer:
                               torch.compile(module, backend=DDPOptimizer(backend)) -> one
                               subgraph per bucket of parameters (reverse graph order)
      loss.backward()          subgraph k's backward yields bucket k's gradients -> their
                               post-accumulate hooks -> bucket k's all-reduce is issued
                               while subgraphs k-1, ..., 0 still run their backward

Why DDPOptimizer and not compiled autograd: a single compiled graph has a single backward
node, which hands every gradient over at its very end, so nothing can overlap. Splitting
the forward graph at bucket boundaries (what dynamo does for torch's DDP) keeps plait's
eager reducer, hooks and `plait.comm` door exactly as they are, works with every backend,
and needs no change to the user's script; compiled autograd would have to trace the
reducer's hooks and turn its collectives into functional ones, and is opt-in in torch.

Dynamo applies DDPOptimizer on its own only to torch's DDP class (a flag read in its
frame converter), which plait may not import; so plait wraps the user's backend itself.
The backend is found on the compile callback that is active while dynamo skips
DDP.forward (CatchErrorsWrapper -> ConvertFrame -> WrapBackendDebug -> backend: the chain
torch's converter itself unwraps for DDPOptimizer). If that chain is not there (another
torch version), the module runs under the active callback as it is: correct, compiled in
one piece, without overlap. The inner compile takes the backend (and with it Inductor's
mode and options), not torch.compile's `dynamic=` and `fullgraph=` (a wrapper that runs
eager cannot be one graph anyway, as with torch's DDP).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

_ORIG = "_torchdynamo_orig_backend"


def backend_of(callback: Any) -> Callable | None:
    """The user's backend behind a compile callback (None when not compiling)."""
    if callback is None or callback is False:
        return None
    convert = getattr(callback, _ORIG, None)  # CatchErrorsWrapper -> ConvertFrame
    debug = getattr(convert, _ORIG, None)  # ConvertFrame -> WrapBackendDebug
    return getattr(debug, _ORIG, None)  # WrapBackendDebug -> the backend itself


def not_traced(fn: Callable | None = None, *, recursive: bool = False) -> Callable:
    """`fn`, skipped by dynamo as `torch.compiler.disable(fn, recursive=recursive)` skips it:
    its own frame runs eagerly (recursive: the frames it calls too; otherwise they are still
    compiled under an active callback), and a trace that reaches a call of it breaks the graph
    there. Marked on the function itself (what torch._dynamo.skip does, without importing
    torch._dynamo) rather than wrapped: the wrapper costs 3 Python frames a call
    (torch._disable_dynamo's lazy import shim, the wrapper, its is_exporting check), every
    forward. Without these C entry points (another torch), the wrapper."""
    if fn is None:
        return functools.partial(not_traced, recursive=recursive)
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # pragma: no cover - torch without per-code frame strategies
        return torch._disable_dynamo(fn, recursive=recursive)
    callees = _FrameAction.SKIP if recursive else _FrameAction.DEFAULT
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, callees))
    fn._torchdynamo_disable = True  # the tracer's mark: a call of fn is not inlined (a graph break)
    return fn


class BucketedCompile:
    """torch.compile of one module split at bucket boundaries, once per user backend."""

    def __init__(self, caps: Sequence[int]) -> None:
        # DDPOptimizer: buckets of `bucket_bytes_cap`, the first no larger (it must not be)
        self.bucket_bytes_cap = max(caps)
        self.first_bucket_cap = min(caps[0], self.bucket_bytes_cap)
        self._compiled: dict[int, tuple[Callable, Callable]] = {}  # id(backend) -> (backend, compiled)

    def compiled(self, fn: Callable, backend: Callable) -> Callable:
        hit = self._compiled.get(id(backend))
        if hit is not None and hit[0] is backend:
            return hit[1]
        from torch._dynamo.backends.distributed import DDPOptimizer

        splitter = DDPOptimizer(bucket_bytes_cap=self.bucket_bytes_cap, backend_compile_fn=backend,
                                first_bucket_cap=self.first_bucket_cap)
        compiled = torch.compile(fn, backend=splitter.compile_fn)
        self._compiled[id(backend)] = (backend, compiled)
        return compiled

    @torch._disable_dynamo
    def compiled_for(self, fn: Callable, callback: Any) -> Callable | None:
        """`fn` compiled in bucket-sized pieces with `callback`'s backend; None when
        `callback` is no compile callback (or one whose backend cannot be found: the
        caller then runs `fn` under it, compiled whole)."""
        backend = backend_of(callback)
        return None if backend is None else self.compiled(fn, backend)


__all__ = ["BucketedCompile", "backend_of", "not_traced"]
