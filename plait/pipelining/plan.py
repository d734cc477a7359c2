"""`plait plan pipeline`: check and simulate a schedule, print its timeline, draw it.

    plait plan pipeline --schedule 1F1B --ranks 4 --microbatches 8 --svg 1f1b.svg
    plait plan pipeline --csv my_schedule.csv --costs 1,2,1

Exit status: 0 the schedule passes the check, 1 it does not (the error names the first bad
action and its rank), 2 the command line is wrong.
"""

from __future__ import annotations

import argparse
import sys

from .schedules import (
    SCHEDULES,
    Costs,
    Schedule,
    ScheduleError,
    Simulation,
    bubble_formula,
    build_schedule,
    check,
    load_csv,
    lower,
    render_ascii,
    save_csv,
    simulate,
    write_png,
    write_svg,
)

_TOPICS = {"pipeline": "check and simulate a pipeline schedule, draw its timeline"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait plan pipeline",
        description="Check a pipeline schedule (built-in or CSV) without starting processes, "
        "simulate it with per-action costs, print bubble, peak activations and a timeline.",
    )
    p.add_argument("--schedule", help=f"built-in schedule: {', '.join(SCHEDULES)}")
    p.add_argument("--ranks", type=int, help="pipeline ranks p")
    p.add_argument("--microbatches", type=int, help="microbatches m per step")
    p.add_argument("--stages-per-rank", type=int, help="v for interleaved/looped schedules")
    p.add_argument("--costs", default="1,2,1", help="F,B,W[,comm[,host]] times; I = B - W (default 1,2,1)")
    p.add_argument("--csv", help="custom schedule in torch's CSV format (one row per rank)")
    p.add_argument("--svg", help="write the timeline picture here")
    p.add_argument("--png", help="also draw a PNG (needs matplotlib)")
    p.add_argument("--lowered", action="store_true", help="print the lists with SEND/RECV")
    p.add_argument("--save-csv", help="write the schedule (lowered with --lowered) as CSV")
    return p


def _load(args: argparse.Namespace) -> Schedule:
    if args.csv:
        if args.schedule:
            raise ValueError("give --schedule or --csv, not both")
        schedule = load_csv(args.csv, num_microbatches=args.microbatches)
        if args.ranks is not None and args.ranks != schedule.num_ranks:
            raise ValueError(f"--ranks {args.ranks} != {schedule.num_ranks} rows in {args.csv}")
        return schedule
    missing = [f"--{n}" for n in ("schedule", "ranks", "microbatches") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --csv FILE)")
    return build_schedule(
        args.schedule, args.ranks, args.microbatches, stages_per_rank=args.stages_per_rank
    )


def _report(sim: Simulation) -> str:
    s, c = sim.schedule, sim.costs
    v = s.num_stages // s.num_ranks if s.num_stages % s.num_ranks == 0 else None
    idle = sum(sim.idle)
    lines = [
        f"bubble: {sim.bubble:.2%} (idle {idle:g} of {s.num_ranks * sim.makespan:g} "
        f"rank-time; makespan {sim.makespan:g}; costs F={c.forward:g} B={c.backward:g} "
        f"I={c.backward - c.weight:g} W={c.weight:g} comm={c.comm:g})",
    ]
    formula = bubble_formula(s.name, s.num_ranks, s.num_microbatches, v or 1)
    if formula is not None and c.comm == 0:  # the formulas hold for any uniform F and B
        lines.append(f"formula: {formula:.2%}")
    stage_w = max(3, len(str(s.num_stages - 1)), len(str(max(sim.peak_in_flight))))
    lines += [
        "peak in flight (microbatches whose activations are held):",
        "  stage " + " ".join(f"{i:>{stage_w}}" for i in range(s.num_stages)),
        "  peak  " + " ".join(f"{n:>{stage_w}}" for n in sim.peak_in_flight),
        "  per rank: "
        + ", ".join(f"rank {r} {n}" for r, n in enumerate(sim.peak_in_flight_per_rank)),
    ]
    return "\n".join(lines)


def _pipeline(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        costs = Costs.parse(args.costs)
        schedule = _load(args)
    except ScheduleError as e:
        print(f"check: FAILED: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"plait plan pipeline: {e}", file=sys.stderr)
        return 2
    v = schedule.num_stages / schedule.num_ranks
    print(
        f"schedule: {schedule.name}, {schedule.num_ranks} ranks, {schedule.num_stages} stages "
        f"({v:g} per rank), {schedule.num_microbatches} microbatches"
    )
    try:
        print(f"check: {check(schedule)}")
        sim = simulate(schedule, costs)
        lowered = lower(schedule.compute_only(), costs=costs) if args.lowered else None
    except ScheduleError as e:
        print(f"check: FAILED: {e}")
        return 1
    print(_report(sim))
    print("timeline:")
    print(render_ascii(sim))
    if lowered is not None:
        print("lowered (with SEND/RECV):")
        print(lowered.format())
    if args.save_csv:
        print(f"csv: wrote {save_csv(lowered or schedule, args.save_csv)}")
    if args.svg:
        print(f"svg: wrote {write_svg(sim, args.svg)}")
    if args.png:
        try:
            print(f"png: wrote {write_png(sim, args.png)}")
        except ImportError as e:
            print(f"png: skipped: {e}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`plait plan <topic> ...`; the one topic so far is `pipeline`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _TOPICS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"plait plan: unknown topic {argv[0]!r}", file=sys.stderr)
        print("usage: plait plan <topic> [args...]\n\ntopics:")
        for name, help_ in _TOPICS.items():
            print(f"  {name:<10} {help_}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return _pipeline(argv[1:])
