"""The README's first command prints only the demo's own lines: no warning, no traceback, no
abort line, on any rank.

After a plain install (no test extra) torch 2.13 printed "Failed to initialize NumPy" on every
rank: `import torch` itself asks for numpy. numpy is therefore a runtime dependency of plait;
the first test holds pyproject to that (this suite's environment has numpy from either side,
so the output test alone could not see it missing)."""

import importlib.metadata
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


def test_main_job_prints_only_the_demo_lines():
    readme = (ROOT / "README.md").read_text()
    assert "plait run --standalone --nproc-per-node 4 -m plait.demo" in readme
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "run", "--standalone", "--nproc-per-node", "4", "-m", "plait.demo"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=400)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout
    unexpected = [line for line in lines if not any(p.fullmatch(line) for p in EXPECTED)]
    assert not unexpected, "lines a user would wonder about:\n" + "\n".join(unexpected)
    assert sum(bool(EXPECTED[0].fullmatch(line)) for line in lines) >= 1 and EXPECTED[1].fullmatch(lines[-1])
