"""`plait plan`: choose the N-D layout before the job starts.

    plait plan --config small --nproc 8 --memory-per-rank 2GiB --top 5
    plait plan --config tiny --nproc 4 --json            # records: layout, memory_bytes_per_rank,
                                                         # bytes_sent_per_rank, step_seconds, command
    plait plan --config tiny --nproc 4 --rejected        # and every rejected layout, with why
    plait plan --compare runs/tiny                       # a run's measured figures against the plan
    plait plan pipeline --schedule 1F1B --ranks 4 --microbatches 8   # one schedule, simulated

Options: `--config NAME|FILE.toml` (default tiny), `--nproc N` (required), `--memory-per-rank`
(e.g. 2GiB, 512MiB, 1e9; layouts over it rank last, marked), `--calibrate` (measure FLOP/s,
host cost per op and Gloo's cost per call among N processes here, at most 30 s, cached per N;
later runs reuse the cache), `--json`, `--top K`
(default 10), `--rejected`; then any `--section.key value`, as `plait train` takes them. The
layout's own values (`--parallel.dp_replicate/dp_shard/cp/tp/pp/pp_schedule/microbatches/
virtual_stages/sequence_parallel`, `--activation_checkpoint.mode`) are what it enumerates; every
other override applies to all layouts (batch, sequence, model size).
"""

from __future__ import annotations

import json
import re
import sys

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--memory-per-rank takes a size such as 2GiB, 512MiB or 1e9, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _parse(argv: list[str]) -> dict:
    opts = {"config": "tiny", "nproc": None, "memory": None, "calibrate": False, "json": False, "top": 10,
            "rejected": False, "rest": []}
    i = 0
    while i < len(argv):
        arg, value = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        flag = {"--calibrate": "calibrate", "--json": "json", "--rejected": "rejected"}.get(arg)
        if arg in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        if flag:
            opts[flag] = True
        elif arg in ("--config", "--nproc", "--memory-per-rank", "--top"):
            if value is None:
                raise ValueError(f"{arg} needs a value")
            key = {"--memory-per-rank": "memory"}.get(arg, arg[2:])
            opts[key] = value
            i += 1
        else:
            opts["rest"].append(arg)
        i += 1
    if opts["nproc"] is None:
        raise ValueError("--nproc N is required: the number of ranks to plan for")
    opts["nproc"], opts["top"] = int(opts["nproc"]), int(opts["top"])
    opts["memory"] = parse_bytes(opts["memory"]) if opts["memory"] else None
    return opts


def table(preds: list, limit: int | None, top: int) -> str:
    head = f"{'#':>3}  {'layout':<34} {'memory/rank':>12} {'bytes/rank/step':>16} {'step':>9} {'tokens/s':>10}  dominant"
    lines = [head, "-" * len(head)]
    for k, p in enumerate(preds[:top], 1):
        mem = _fmt_bytes(p.memory.total) + ("" if p.fits else " OVER")
        lines.append(f"{k:>3}  {p.layout.choice.describe():<34} {mem:>12} {_fmt_bytes(p.bytes_sent):>16} "
                     f"{p.time.step_s * 1e3:>7.2f}ms {p.tokens_per_s:>10.0f}  {p.time.dominant()}")
    if limit is not None:
        lines.append(f"memory limit per rank: {_fmt_bytes(limit)}")
    return "\n".join(lines)


def _collectives(hw) -> str:
    if hw.collectives:
        return f"per call among {hw.nproc} processes: " + ", ".join(
            f"g{g} {c * 1e3:.2f} ms {b:.2g} B/s" for g, c, b in hw.collectives)
    return f"{hw.bandwidth:.3g} B/s, {hw.latency * 1e6:.0f} us/call"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "pipeline":
        from plait.pipelining.plan import main as pipeline_main

        return pipeline_main(argv)
    if argv and argv[0] == "--compare":
        from plait.plan.compare import compare, format_rows

        try:
            if len(argv) != 2:
                raise ValueError("--compare takes one run folder (a plait train job.dir)")
            rows, equal = compare(argv[1])  # the calibration cached for the run's world size, if any
        except (ValueError, TypeError) as e:
            print(f"plait plan: {e}", file=sys.stderr)
            return 2
        print(format_rows(rows))
        return 0 if equal else 1
    from plait.plan.hardware import Hardware
    from plait.plan.planner import plan
    from plait.train.config import apply_overrides, load

    try:
        opts = _parse(argv)
        config = apply_overrides(load(opts["config"]), opts["rest"])
        from plait.train.layout import model_args

        args = model_args(config)
        hw = Hardware()
        if opts["calibrate"]:
            from plait.plan.calibrate import calibrate

            hw = calibrate(args, batch=config.training.batch_size // opts["nproc"], seq_len=config.training.seq_len,
                           nproc=opts["nproc"])
        else:
            from plait.plan.calibrate import cached

            hw = cached(opts["nproc"]) or hw
        import dataclasses

        from plait.plan.hardware import host_cores

        hw = dataclasses.replace(hw, cores=host_cores())  # the ranks of a one-host job share them
        preds, rejected = plan(config, opts["nproc"], hw=hw, memory_limit=opts["memory"],
                               config_name=opts["config"], user_overrides=opts["rest"])
    except (ValueError, TypeError) as e:
        print(f"plait plan: {e}", file=sys.stderr)
        return 2
    if opts["json"]:
        out = [p.record() for p in preds[: opts["top"]]]
        if opts["rejected"]:
            out += [{"describe": r.choice.describe(), "rejected": r.reason} for r in rejected]
        print(json.dumps(out, indent=1))
        return 0 if preds else 1
    print(f"{len(preds)} layouts of {opts['nproc']} ranks fit {opts['config']} ({len(rejected)} rejected); "
          f"hardware: {hw.flop_rate:.3g} FLOP/s, {hw.op_s * 1e6:.1f} us/op, {hw.dtensor_op_s * 1e6:.0f} us/DTensor op, "
          f"{_collectives(hw)}, {hw.cores} cores ({hw.source})")
    if preds:
        print(table(preds, opts["memory"], opts["top"]))
        best = preds[0]
        print(f"best: {best.layout.choice.describe()} ({'fits' if best.fits else 'over the memory limit'})")
        print(f"  {best.command}")
    if opts["rejected"]:
        print("rejected:")
        for r in rejected:
            print(f"  {r.choice.describe():<34} {r.reason}")
    return 0 if preds else 1


if __name__ == "__main__":
    sys.exit(main())
