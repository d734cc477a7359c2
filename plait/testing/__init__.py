"""plait.testing — run a function on N ranks (Gloo, CPU) from a test, fast.

    from plait.testing import run_distributed, distributed

    def check_sum(n):                       # runs on every rank
        g = comm.world_group()
        t = torch.full((n,), comm.get_rank(g) + 1.0)
        comm.all_reduce(t, group=g)
        return t

    results = run_distributed(check_sum, 3, world_size=4)   # one result per rank

    @distributed(world_sizes=[1, 2, 4])     # a pytest test, parametrized over world size
    def test_barrier():
        comm.barrier(group=comm.world_group())

Ranks live in a persistent pool per world size (started once, reused by every test), use
one thread each, and share a Gloo default group. A failure on any rank fails the caller
with that rank's traceback; a timeout fails it with every rank's Python stack.
`fn` must be importable by name (a module-level function), as must its arguments.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

from plait.testing.asserts import assert_shard_close, assert_synced, chunk_sizes
from plait.testing.pool import DistributedTestError, get_pool, shutdown

DEFAULT_TIMEOUT_S = float(os.environ.get("PLAIT_TEST_TIMEOUT", 120))


def run_distributed(fn: Callable, *args: Any, world_size: int, timeout: float = DEFAULT_TIMEOUT_S,
                    **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks at once; return each rank's result."""
    __tracebackhide__ = True
    if not 1 <= world_size <= 64:
        raise ValueError(f"world_size {world_size} is not in [1, 64]")
    return get_pool(world_size).run(fn, args, kwargs, timeout)


def distributed(world_sizes: Sequence[int], *, timeout: float = DEFAULT_TIMEOUT_S) -> Callable:
    """Make a pytest test whose body runs on every rank, once per world size."""
    import pytest

    def decorate(body: Callable) -> Callable:
        params = list(inspect.signature(body).parameters.values())
        wants_world = any(p.name == "world_size" for p in params)

        @functools.wraps(body)
        def test(world_size: int, **params: Any) -> None:
            __tracebackhide__ = True
            if wants_world:
                params["world_size"] = world_size
            get_pool(world_size).run(test, (), params, timeout)

        test.__plait_body__ = body  # what a worker runs when it unpickles `test`
        keyword = inspect.Parameter.KEYWORD_ONLY
        world = [] if wants_world else [inspect.Parameter("world_size", keyword)]
        test.__signature__ = inspect.Signature(world + [p.replace(kind=keyword) for p in params])
        del test.__wrapped__  # pytest must see the new signature, not body's
        return pytest.mark.parametrize("world_size", list(world_sizes), ids=lambda n: f"ws{n}")(test)

    return decorate


__all__ = [
    "DistributedTestError", "assert_shard_close", "assert_synced", "chunk_sizes", "distributed",
    "run_distributed", "shutdown",
]
