"""`plait train` / `python -m plait.train`: the trainer from the command line.

    plait run --standalone --nproc-per-node 4 -m plait.train --config small --parallel.tp 2
    plait train --config tiny --print-config          # the resolved config, as TOML

Arguments: `--config NAME|FILE.toml` (default: tiny), `--print-config`, `--compile` (short for
`--compile.enabled`), then any `--section.key value`; `--parallel.auto true` replaces the layout
with `plait plan`'s best for WORLD_SIZE (printed before training starts). The config and the layout are checked
against WORLD_SIZE before the process group starts, so a wrong layout fails at once on every
rank with the numbers. Without a launcher (no RANK in the environment) it trains in one process.
"""

from __future__ import annotations

import os
import socket
import sys

from plait.train.config import apply_overrides, load


def parse(argv: list[str]):
    """(config, print_config) from the command line."""
    name, print_config, rest, i = "tiny", False, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                name = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                name, i = argv[i + 1], i + 1
            else:
                raise ValueError("--config needs a value: a shipped name (tiny, small, 100m) or a TOML file")
        elif arg == "--print-config":
            print_config = True
        elif arg == "--compile":
            rest += ["--compile.enabled", "true"]
        else:
            rest.append(arg)
        i += 1
    return apply_overrides(load(name), rest), print_config


def _single_process_env() -> None:
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, print_config = parse(argv)
        from plait.train.layout import check

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if config.parallel.auto:
            from plait.plan.planner import auto_layout

            config, best = auto_layout(config, world)
            if os.environ.get("RANK", "0") == "0":
                print(f"plait train: --parallel.auto chose {best.layout.choice.describe()} of {world} ranks "
                      f"(plait plan: {best.time.step_s * 1e3:.2f} ms/step, {best.memory.total / 2**20:.1f} MiB/rank): "
                      + " ".join(best.layout.choice.overrides()), flush=True)
        _, dims = check(config, world)
        if not print_config:
            from plait.train.checkpointing import check_resume

            check_resume(config)
    except (ValueError, TypeError) as e:
        print(f"plait train: {e}", file=sys.stderr)
        return 2
    if print_config:
        print(f"# {dims.describe()}, microbatches {dims.microbatches}, stages {dims.num_stages}")
        print(config.to_toml(), end="")
        return 0
    import torch

    from plait import comm
    from plait.train.trainer import train

    _single_process_env()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    comm.init_process_group()
    try:
        result = train(config)
        if comm.global_rank() == 0:
            print(result.summary, flush=True)
    finally:
        comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
