"""`plait run`: torchrun's launcher, rebuilt on c10d's TCPStore, with restarts that work.

    plait run --standalone --nproc-per-node 4 train.py --lr 3e-4
    plait run --nnodes 2:4 --nproc-per-node 8 --rdzv-endpoint node0:29400 --max-restarts 3 train.py

One agent per node (agent.py) rendezvouses with the others (rendezvous.py, over the job's
TCPStore; one node needs no store at all), starts one worker per local rank with torchrun's
environment (workers.py), prefixes and files their output (logs.py), and when any worker on
any node fails, stops every worker everywhere and restarts the job from a fresh round with a
fresh worker store — up to --max-restarts for the whole job. Heartbeats (heartbeat.py) let
survivors notice a dead node in bounded time. Workers report exceptions through an error file
(errors.py, bootstrap.py), named in the launcher's summary.

Layering: imports nothing from other plait packages and no torch.distributed collective; torch
itself is imported only when a TCPStore is needed (store.py), so the launcher starts fast.
"""

from __future__ import annotations

import sys

from plait.run.errors import record

__all__ = ["main", "record"]


def main(argv: list[str] | None = None) -> int:
    """Run `plait run` with `argv` (the arguments after `run`); returns the exit code."""
    from plait.run.agent import Agent
    from plait.run.args import parse_config
    from plait.run.config import LaunchError

    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_config(argv)
        return Agent(cfg).run()
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except LaunchError as e:
        print(f"plait run: error: {e}", file=sys.stderr)
        return 2
