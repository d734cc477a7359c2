"""The README's first command — `plait train` on 4 local ranks, FSDP x TP — runs (with the tiny
config in place of the small one, for time) and prints only the trainer's own lines: the
progress bar and the summary, in which the loss has fallen; no warning, no traceback, on any
rank. The demo (`plait demo`, the README's first command before) prints only its lines too.

After a plain install (no test extra) torch 2.13 printed "Failed to initialize NumPy" on every
rank: `import torch` itself asks for numpy. numpy is therefore a runtime dependency of plait;
the first test holds pyproject to that (this suite's environment has numpy from either side,
so the output test alone could not see it missing)."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what the demo prints on rank 0 (plait/demo.py), behind plait run's "[rank N] " prefix
EXPECTED = [
    re.compile(r"\[rank 0\] step \d+: loss \d+\.\d+ on 4 ranks, \d+\.\d+ in one process"),
    re.compile(r"\[rank 0\] max \|parameter difference\| after \d+ steps: \S+"),
]


def test_numpy_is_a_runtime_dependency():
    reqs = importlib.metadata.requires("plait") or []
    unconditional = [r for r in reqs if ";" not in r]  # a marker (extra == "test") makes it optional
    assert any(re.match(r"numpy\b", r) for r in unconditional), reqs


MAIN = "plait run --standalone --nproc-per-node 4 -m plait.train --config small --parallel.dp_shard 2 --parallel.tp 2"
# the summary table of plait/train/trainer.py, behind "[rank 0] "; the bar is tqdm's, on rank 0
TRAIN = [re.compile(p) for p in (
    r"\[rank 0\] -+", r"\[rank 0\] layout +dp_replicate\(1\) x dp_shard\(2\) x tp\(2\) x pp\(1\) = 4 ranks",
    r"\[rank 0\] model +tiny: [\d,]+ parameters, \d+ layers, vocab 256", r"\[rank 0\] steps +1\.\.\d+ \(.*\)",
    r"\[rank 0\] loss +(\d+\.\d+) -> (\d+\.\d+)", r"\[rank 0\] val loss +.*", r"\[rank 0\] tokens/s +.*",
    r"\[rank 0\] MFU +.*", r"\[rank 0\] peak memory +.*",
    r"\[rank 0\] bytes sent +dp_shard [\d,]+, tp [\d,]+, dp_shard\+tp [\d,]+ per step \(.*\)",
    r"(\[rank 0\] )?train: +\d+%\|.*\| \d+/\d+ .*", r"\[rank 0\]")]  # tqdm redraws after "\r"


def test_main_job_trains_and_prints_only_the_trainers_lines(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert MAIN in readme
    cmd = MAIN.replace("--config small", "--config tiny").split()[1:] + ["--job.dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "plait", *cmd], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    lines = [line.strip() for line in proc.stdout.replace("\r", "\n").splitlines() if line.strip()]
    assert proc.returncode == 0, proc.stdout
    unexpected = [line for line in lines if not any(p.fullmatch(line) for p in TRAIN)]
    assert not unexpected, "lines a user would wonder about:\n" + "\n".join(unexpected)
    (first, last), = [TRAIN[4].fullmatch(line).groups() for line in lines if TRAIN[4].fullmatch(line)]
    assert float(last) < float(first) - 0.5, (first, last)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 11))


def test_demo_prints_only_the_demo_lines():
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "run", "--standalone", "--nproc-per-node", "4", "-m", "plait.demo"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=400)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout
    unexpected = [line for line in lines if not any(p.fullmatch(line) for p in EXPECTED)]
    assert not unexpected, "lines a user would wonder about:\n" + "\n".join(unexpected)
    assert sum(bool(EXPECTED[0].fullmatch(line)) for line in lines) >= 1 and EXPECTED[1].fullmatch(lines[-1])
