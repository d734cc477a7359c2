"""The lint rule that keeps torch's own implementations of what plait builds out of plait/.

The list is docs/DESIGN.md's; each module must be refused by `ruff check` under plait/, in any
import spelling, and allowed in tests/ and benchmarks/.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BANNED = [
    "torch.distributed.device_mesh", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed._composable", "torch.distributed.pipelining", "torch.distributed.checkpoint",
    "torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher",
    "torch.distributed.algorithms", "torch.distributed.optim", "torch.distributed.flight_recorder",
    "torch.distributed._tools",
    "torch.nn.parallel",
]


def _ruff(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"
    return subprocess.run([exe, "check", "--no-cache", "--select", "TID251", "--config", str(ROOT / "pyproject.toml"),
                           str(path)], capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("module", BANNED)
def test_banned_inside_plait(module, tmp_path):
    parent, _, leaf = module.rpartition(".")
    target = ROOT / "plait" / f"_lint_probe_{leaf.strip('_')}.py"
    target.write_text(f"import {module}\nfrom {parent} import {leaf}\nx = {module}.__name__\n")
    try:
        result = _ruff(target)
    finally:
        target.unlink()
    assert result.returncode != 0 and result.stdout.count(f"`{module}` is banned") >= 2, result.stdout


def test_allowed_in_tests_and_benchmarks():
    target = ROOT / "tests" / "_lint_probe_allowed.py"
    target.write_text("".join(f"import {m}\n" for m in BANNED))
    try:
        result = _ruff(target)
    finally:
        target.unlink()
    assert result.returncode == 0, result.stdout
