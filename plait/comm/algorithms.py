"""Which implementation runs each collective, per backend and message size.

Gloo's all-gather can be replaced by an all-reduce of a zero-filled output in which each
rank wrote its own slice, the bits reinterpreted as int32/uint8 so the result is
bit-exact for any dtype (NaN payloads and -0.0 included: only one rank contributes
non-zero bits per element). A reduce-scatter can be replaced by an all-reduce of a copy
of the input, keeping this rank's slice.

Measured with `python -m benchmarks comm` (torch 2.13, Gloo, 2 and 4 ranks, warmed up,
medians of 15 batched samples), forcing each implementation through plait.comm:

    all-gather      16 MiB: native 11.9 ms, via all-reduce 15.5 ms (2 ranks); 21.6 / 27.8 (4)
                    64 MiB: native 86.8 ms, via all-reduce 56.3 ms (2 ranks); 133.6 / 111.8 (4)
    reduce-scatter  16 MiB: native 17.4 ms, via all-reduce 19.9 ms (2 ranks); 35.2 / 35.7 (4)
                    64 MiB: native 90.3 ms, via all-reduce 113.6 ms (2 ranks); 217.1 / 191.0 (4)

So on Gloo, all-gathers past 32 MiB run as an all-reduce, and reduce-scatters stay
native (the all-reduce form won only one of four large cases). Uneven all-gathers on
Gloo always take the all-reduce form: it needs no padding copies. NCCL keeps its native
collectives. Override per op with `set_algorithm("all_gather", "native")` or
`PLAIT_COMM_ALGORITHMS="all_gather=native,reduce_scatter=all_reduce"`.
"""

from __future__ import annotations

import math
import os

IMPLS = ("native", "all_reduce")
OPS = ("all_gather", "reduce_scatter")

# (backend, op) -> [(max_bytes_inclusive, impl), ...]; bytes are the full (gathered /
# pre-scatter) tensor's size. The first row whose bound covers the size wins.
DEFAULT_TABLE: dict[tuple[str, str], list[tuple[float, str]]] = {
    ("gloo", "all_gather"): [(32 << 20, "native"), (math.inf, "all_reduce")],
}

_overrides: dict[str, str] = {}


def _parse_env() -> dict[str, str]:
    spec = os.environ.get("PLAIT_COMM_ALGORITHMS", "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        op, _, impl = item.partition("=")
        _check(op.strip(), impl.strip(), source="PLAIT_COMM_ALGORITHMS")
        out[op.strip()] = impl.strip()
    return out


def _check(op: str, impl: str, source: str) -> None:
    if op not in OPS:
        raise ValueError(f"{source}: unknown op {op!r}; choose from {list(OPS)}")
    if impl not in IMPLS:
        raise ValueError(f"{source}: unknown implementation {impl!r} for {op}; choose from {list(IMPLS)}")


def set_algorithm(op: str, impl: str | None) -> None:
    """Force `impl` ("native" or "all_reduce") for `op` on every backend; None restores
    the measured table."""
    if impl is None:
        _overrides.pop(op, None)
        return
    _check(op, impl, source="set_algorithm")
    _overrides[op] = impl


def choose(op: str, backend: str, nbytes: int) -> str:
    """The implementation to run `op` with on `backend` for a `nbytes` full tensor."""
    impl = _overrides.get(op) or _env_overrides.get(op)
    if impl is not None:
        return impl
    for bound, impl in DEFAULT_TABLE.get((backend, op), ()):
        if nbytes <= bound:
            return impl
    return "native"


_env_overrides = _parse_env()
