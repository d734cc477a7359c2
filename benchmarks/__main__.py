"""The benchmark runner: `python -m benchmarks [NAME ...] [--quick]`.

Each `benchmarks/bench_<name>.py` exposes `run(quick: bool) -> None`, which measures plait
against torch.distributed's own implementation in the same run and prints its table with
`benchmarks.common.print_table`. Benchmarks print figures; they never pass or fail on time.
Run them alone: a test suite beside them saturates the two cores.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time

import benchmarks


def _available() -> list[str]:
    return sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules(benchmarks.__path__)
        if m.name.startswith("bench_")
    )


def main(argv: list[str] | None = None) -> int:
    names = _available()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {names})")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(names))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {names}")
    for name in args.names or names:
        t0 = time.perf_counter()
        importlib.import_module(f"benchmarks.bench_{name}").run(quick=args.quick)
        print(f"({name}: {time.perf_counter() - t0:.1f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
