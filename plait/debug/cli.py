"""`plait debug ...`: tools for a job that hung or failed.

    plait debug analyze DIR [--json]   read every rank's flight-recorder dump in DIR (default
                                       $PLAIT_TRACE_DIR, else $TMPDIR/plait_trace) and name
                                       the first op the ranks disagree on, its kind, the
                                       culprit ranks and their call sites

Exit status: 0 no problem found, 1 a problem found, 2 nothing to analyze (or bad usage).
The analyzer reads JSON only: this command starts without importing torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from plait.debug.analyze import Analysis, analyze
from plait.debug.config import default_trace_dir


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait debug", description="debug a distributed job that hung or failed")
    sub = parser.add_subparsers(dest="command", required=True)
    analyze = sub.add_parser("analyze", help="find the first op the ranks disagree on, from their dumps")
    analyze.add_argument("dir", nargs="?", default=os.environ.get("PLAIT_TRACE_DIR") or default_trace_dir(),
                         help="folder of rank<R>.json dumps (default: $PLAIT_TRACE_DIR or %(default)s)")
    analyze.add_argument("--json", action="store_true", help="print the analysis as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = analyze(args.dir)
    except FileNotFoundError as e:
        print(f"plait debug analyze: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render(result))
    return 1 if result.problems else 0


def render(a: Analysis) -> str:
    """The few lines a person acts on."""
    dumped = [r for r, v in a.ranks.items() if v["source"] == "dump"]
    lines = [f"plait debug analyze {a.directory}: world size {a.world_size}, dumps from ranks {dumped}"
             + (f", job {a.job_id}" if a.job_id else "")]
    reported = {r: v["source"] for r, v in a.ranks.items() if v["source"] != "dump"}
    if reported:
        lines.append("  described by a peer's report: " + ", ".join(f"rank {r} ({s})" for r, s in reported.items()))
    if a.missing_dumps:
        lines.append(f"  no dump from ranks {a.missing_dumps} (crashed, killed, or exited normally)")
    lines += [f"  warning: {w}" for w in a.warnings]
    p = a.first
    if p is None:
        lines.append("no disagreement found: every group's ops match across the ranks' dumps")
        return "\n".join(lines + [f"hint: {h}" for h in a.hints])
    where = (f"{p.op} #{p.seq} from rank {p.p2p['src']} to rank {p.p2p['dst']}" if p.p2p else f"{p.op} #{p.seq}")
    lines.append(f"PROBLEM: {p.kind} — {where} on group {p.group} (global ranks {p.group_ranks})")
    for side in p.sides:
        label = f"rank {side['ranks'][0]}" if len(side["ranks"]) == 1 else f"ranks {side['ranks']}"
        if side["call"] is None:
            lines.append(f"  {label}: never entered it — {side['state']}")
        else:
            lines.append(f"  {label}: {side['call']} at {side['site']} ({side['state']})")
    blame = f"rank {p.culprits[0]}" if len(p.culprits) == 1 else f"ranks {p.culprits}"
    lines.append(f"culprit: {blame} — {p.why}" if p.culprits else f"culprit: undecided — {p.why}")
    lines += [f"hint: {h}" for h in a.hints]
    if len(a.problems) > 1:
        lines.append(f"({len(a.problems) - 1} more problem(s) after this one; --json lists them all)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
