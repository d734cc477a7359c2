"""torch's FSDP+TP and FSDP2 example flows as script files that run under `plait run` and,
with torch's imports, under torchrun, in the same test: the numbers each prints agree.

scripts/fsdp_tp.py follows pytorch/examples distributed/tensor_parallelism/fsdp_tp_example.py
(2 x 2 (dp, tp), the example's plan, fully_shard per block and the root, AdamW foreach, every
rank its own init) and scripts/fsdp2.py follows distributed/FSDP2/example.py + checkpoint.py
(meta init, a full state dict loaded by set_model_state_dict broadcast from rank 0 with
--dcp-api or by distribute_tensor + load_state_dict(assign=True) without, train, save full
state dicts from rank 0, a second launch resumes). They are plait's own files written to
those flows, not copies of the examples' sources. The torch copy is the file with its
`from plait.X` import lines turned into `from torch.distributed.X` (`torch_copy`, which
checks that nothing else differs). torch's DTensor never meets SDPA here: the Llama's
attention runs on ColwiseParallel's local outputs, so no sharding rule for
aten._scaled_dot_product_flash_attention_for_cpu is needed on the torch side.

Tolerances: every printed number within 1e-5 relative of torch's. The two libraries reduce
the same float32 terms in other orders (reduce-scatter, all-reduce); measured: FSDP x TP
output sums equal to all 10 printed digits for 10 steps, FSDP2 losses within 1.1e-7
relative over 10 steps of Adam (lr 1e-2, clipped) and a resume. A resumed run equals plait's
uninterrupted run exactly (the same shards, the same state, the same order of reduction);
one uninterrupted run, under --dcp-api, serves both APIs (the `uninterrupted` fixture).
"""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"
TORCH_MODULES = ("device_mesh", "fsdp", "tensor", "checkpoint")
LAUNCHERS = {"plait": [sys.executable, "-m", "plait.run"], "torch": [sys.executable, "-m", "torch.distributed.run"]}
NUMBER = r"(-?[0-9.]+e[-+][0-9]+)"
RTOL = 1e-5


def torch_copy(source: str) -> str:
    """The script with torch's imports: `from plait.X` -> `from torch.distributed.X` for X in
    TORCH_MODULES, on import lines only."""
    pattern = re.compile(rf"^from plait\.({'|'.join(TORCH_MODULES)})\b", flags=re.M)
    copy = pattern.sub(r"from torch.distributed.\1", source)
    changed = [(a, b) for a, b in zip(source.splitlines(), copy.splitlines(), strict=True) if a != b]
    assert changed and all(a.startswith("from plait.") and b.startswith("from torch.distributed.")
                           for a, b in changed), changed
    return copy


def _launch(lib: str, script: Path, cwd: Path, ranks: int, *args: str) -> str:
    argv = [*LAUNCHERS[lib], "--standalone", "--nproc-per-node", str(ranks), str(script), *args]
    proc = subprocess.run(argv, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, f"{lib} {script.name} {args} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    return proc.stdout


def _numbers(out: str, word: str) -> dict[tuple[int, int], float]:
    """(rank, step) -> the number each rank printed after `word` (lines may interleave)."""
    found = {(int(r), int(s)): float(v) for r, s, v in re.findall(rf"rank (\d+) step (\d+) {word} {NUMBER}", out)}
    assert found, out[-3000:]
    return found


def _scripts(tmp_path: Path, name: str) -> dict[str, Path]:
    source = (SCRIPTS / name).read_text()
    paths = {"plait": tmp_path / f"plait_{name}", "torch": tmp_path / f"torch_{name}"}
    paths["plait"].write_text(source)
    paths["torch"].write_text(torch_copy(source))
    return paths


def _assert_close(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert abs(ours[key] - value) <= RTOL * abs(value), (key, ours[key], value)


def test_fsdp_tp_example_has_torchs_placements_and_numbers(tmp_path):
    scripts = _scripts(tmp_path, "fsdp_tp.py")
    with ThreadPoolExecutor(2) as pool:
        outs = dict(zip(scripts, pool.map(lambda lib: _launch(lib, scripts[lib], tmp_path, 4, "--steps", "10"),
                                          scripts)))
    placements = {lib: re.findall(r"placement (\S+) (\(.*\))", out) for lib, out in outs.items()}
    assert placements["plait"] == placements["torch"] and len(placements["torch"]) == 21
    assert ("layers.0.attention.wq.weight", "(_StridedShard(dim=0, sf=2), Shard(dim=0))") in placements["torch"]
    sums = {lib: _numbers(out, "sum") for lib, out in outs.items()}
    assert len(sums["torch"]) == 4 * 10
    _assert_close(sums["plait"], sums["torch"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """plait's fsdp2 losses over 10 steps in one launch (--dcp-api), shared by both APIs' tests:
    the pretrained model loads to the same shards either way, so each API's resumed run must
    equal this one exactly (one launch of 2 ranks for both, not one each)."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    script = _scripts(cwd, "fsdp2.py")["plait"]
    return _numbers(_launch("plait", script, cwd, 2, "--dcp-api", "--steps", "10"), "loss")


@pytest.mark.parametrize("api", ["--dcp-api", "--dtensor-api"])
def test_fsdp2_example_resumes_to_torchs_numbers(tmp_path, api, uninterrupted):
    scripts = _scripts(tmp_path, "fsdp2.py")
    flags = [api] if api == "--dcp-api" else []

    def two_launches(lib):
        cwd = tmp_path / lib
        cwd.mkdir()
        first = _launch(lib, scripts[lib], cwd, 2, *flags)  # trains steps 0-4, saves
        second = _launch(lib, scripts[lib], cwd, 2, *flags)  # finds checkpoints/<api>/5, resumes
        return {**_numbers(first, "loss"), **_numbers(second, "loss")}

    with ThreadPoolExecutor(2) as pool:
        losses = dict(zip(scripts, pool.map(two_launches, scripts)))
    assert sorted(losses["torch"]) == [(r, s) for r in range(2) for s in range(10)]
    _assert_close(losses["plait"], losses["torch"])
    folder = "dcp_api" if flags else "dtensor_api"
    ours, theirs = (torch.load(tmp_path / lib / "checkpoints" / folder / "10" / "model.pt") for lib in scripts)
    assert ours.keys() == theirs.keys()
    for fqn, value in theirs.items():
        torch.testing.assert_close(ours[fqn], value, rtol=1e-4, atol=1e-5, msg=lambda m, f=fqn: f"{f}: {m}")
    assert uninterrupted == losses["plait"]
