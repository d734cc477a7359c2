"""Which implementation runs each collective, per backend and message size.

Gloo (torch 2.13, 2 ranks, fp32) runs `all_gather_into_tensor` and `reduce_scatter_tensor`
slower than an all-reduce of the same output at large sizes: measured 16 MiB per rank,
all-reduce 12.2 ms, all-gather 32.7 ms, reduce-scatter 25.9 ms. So on Gloo, past a
threshold, plait

- all-gathers by all-reducing a zero-filled output in which each rank wrote its own
  slice, the bits reinterpreted as int32/uint8 so the result is bit-exact for any dtype
  (NaN payloads and -0.0 included): only one rank contributes non-zero bits per element;
- reduce-scatters by all-reducing a copy of the input and keeping this rank's slice.

The thresholds below come from `python -m benchmarks comm`, which prints both
implementations side by side per size; rerun it on new hardware and adjust. NCCL keeps
its native collectives. Override per op with `set_algorithm("all_gather", "native")` or
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
    ("gloo", "all_gather"): [(4 << 20, "native"), (math.inf, "all_reduce")],
    ("gloo", "reduce_scatter"): [(math.inf, "all_reduce")],
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
