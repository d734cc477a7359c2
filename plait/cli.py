"""The `plait` command: one entry point, one subcommand per tool.

Each subcommand lives in its own module and exposes `main(argv) -> int`; this file only
dispatches, importing the subcommand's module lazily so `plait run` starts without
importing what `plait plan` needs.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module exposing main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("plait.demo", "train a small model on N local ranks, gradients all-reduced by plait.comm"),
    "train": ("plait.train.cli", "train the reference Llama on an N-D layout (run it under `plait run`)"),
    "generate": ("plait.generate", "sample text from a checkpoint of `plait train`"),
    "plot": ("plait.plot", "draw a run's metrics.jsonl (loss, throughput) to an image"),
    "run": ("plait.run", "launch a distributed job (torchrun's flags)"),
    "plan": ("plait.plan.cli", "choose the N-D layout (memory, bytes, step time per rank); `plan pipeline`: a schedule"),
    "debug": ("plait.debug.cli", "analyze flight-recorder dumps of a hung job"),
    "checkpoint": ("plait.checkpoint.tools", "inspect, verify, consolidate or import (torch DCP) a checkpoint"),
}


def _usage() -> str:
    lines = ["usage: plait <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"plait: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"plait: command {name!r} is not available in this build ({e})", file=sys.stderr)
            return 2
        raise
    code = int(module.main(rest) or 0)
    if name == "run":
        # the launcher has stopped every worker and cleaned up; skip torch's interpreter
        # teardown (~0.7 s), as `python -m plait.run` does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
