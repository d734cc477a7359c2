"""`plait plot RUN.jsonl -o RUN.png`: a run's curves from its metrics log — train and validation
loss per step (left), global tokens/s per step (right). matplotlib (`pip install 'plait[plot]'`).

    metrics.jsonl lines {"kind": "step", "step", "loss", "val_loss", "tokens_per_s", ...}
    -> (steps, loss), (val steps, val loss), (steps, tokens/s) -> two axes -> PNG/SVG/PDF
A resumed run appends to the same log: a step logged twice keeps its last record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_steps(path: str | Path) -> list[dict]:
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("kind") == "step":
                by_step[int(record["step"])] = record
    if not by_step:
        raise ValueError(f"{path} has no step records (is it a plait train metrics.jsonl?)")
    return [by_step[s] for s in sorted(by_step)]


def plot(path: str | Path, out: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise ModuleNotFoundError("plait plot needs matplotlib: pip install 'plait[plot]'") from None
    steps = read_steps(path)
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train")
    val = [r for r in steps if r.get("val_loss") is not None]
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_tps.plot([r["step"] for r in steps], [r["tokens_per_s"] for r in steps])
    ax_tps.set(xlabel="step", ylabel="tokens/s (global)", title="throughput")
    fig.suptitle(Path(path).parent.name or str(path))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait plot", description=__doc__.split("\n")[0])
    parser.add_argument("jsonl", help="a run's metrics.jsonl")
    parser.add_argument("-o", "--output", default=None, help="image file (default: RUN.png beside it)")
    args = parser.parse_args(argv)
    out = args.output or str(Path(args.jsonl).with_suffix(".png"))
    try:
        plot(args.jsonl, out)
    except (ValueError, FileNotFoundError) as e:
        print(f"plait plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
