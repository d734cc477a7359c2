"""torch's FSDP+TP and FSDP2 example flows as script files that run under `plait run` and,
with torch's imports, under torchrun, in the same test: the numbers each prints agree.

scripts/fsdp_tp.py follows pytorch/examples distributed/tensor_parallelism/fsdp_tp_example.py
(2 x 2 (dp, tp), the example's plan, fully_shard per block and the root, AdamW foreach, every
rank its own init) and scripts/fsdp2.py follows distributed/FSDP2/example.py + checkpoint.py
(meta init, a full state dict loaded by set_model_state_dict broadcast from rank 0 with
--dcp-api or by distribute_tensor + load_state_dict(assign=True) without, train, save full
state dicts from rank 0, a second run resumes). They are plait's own files written to
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
one uninterrupted run, under --dcp-api, serves both APIs.

The fsdp2 runs (per API a first and a resuming run, per library; plait's uninterrupted run) are
forks of one launch per library through tests/readme_driver.py (the `fsdp2_runs` fixture): a
fork finalizes as a fresh interpreter, and torch is imported by 2 workers per library instead of
2 per run (9 launches of 3 interpreters were 2).
"""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests import torchrun

SCRIPTS = Path(__file__).parent / "scripts"
DRIVER = Path(__file__).resolve().parents[1] / "readme_driver.py"
TORCH_MODULES = ("device_mesh", "fsdp", "tensor", "checkpoint")
LAUNCHERS = {"plait": [sys.executable, "-m", "plait.run"], "torch": torchrun.ARGV}
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


def _launch(lib: str, script: Path, cwd: Path, ranks: int, *args: str, env: dict | None = None) -> str:
    argv = [*LAUNCHERS[lib], "--standalone", "--nproc-per-node", str(ranks), str(script), *args]
    proc = subprocess.run(argv, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, f"{lib} {script.name} {args} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    return proc.stdout


def _numbers(out: str, word: str) -> dict[tuple[int, int], float]:
    """(rank, step) -> the number each rank printed after `word` (lines may interleave)."""
    found = {(int(r), int(s)): float(v) for r, s, v in re.findall(rf"rank (\d+) step (\d+) {word} {NUMBER}", out)}
    assert found, out[-3000:]
    return found


def _scripts(tmp_path: Path, name: str, *modules: str) -> dict[str, Path]:
    source = (SCRIPTS / name).read_text()
    paths = {"plait": tmp_path / f"plait_{name}", "torch": tmp_path / f"torch_{name}"}
    paths["plait"].write_text(source)
    paths["torch"].write_text(torch_copy(source))
    for module in modules:  # a model file beside the scripts, the same for both
        (tmp_path / module).write_text((SCRIPTS / module).read_text())
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


def test_fsdp_tp_example_with_complex_rotary_has_torchs_gradients(tmp_path):
    """torch's fsdp_tp_example plan on its llama2 model's shape (complex rotary embeddings,
    `freqs_cis` a Replicate DTensor, wq/wk/wv DTensors into attention): every parameter's
    gradient after the first backward equals torch's (its sum and norm to 1e-6 relative;
    measured: all 12 printed digits equal), the output sums for 10 steps within 1e-5, and
    plait runs it without one op through the replicate-everything fallback (the error
    policy). plait's lost conj bit made wq's and wk's gradients wrong by order 1 here."""
    scripts = _scripts(tmp_path, "fsdp_tp_rotary.py", "llama2_rotary.py")
    envs = {"plait": {"PLAIT_DTENSOR_FALLBACK": "error"}, "torch": {}}
    with ThreadPoolExecutor(2) as pool:
        outs = dict(zip(scripts, pool.map(
            lambda lib: _launch(lib, scripts[lib], tmp_path, 4, "--steps", "10", env=envs[lib]), scripts)))
    grads = {lib: {fqn: (float(a), float(b)) for fqn, a, b in re.findall(rf"grad (\S+) sum {NUMBER} norm {NUMBER}", out)}
             for lib, out in outs.items()}
    assert len(grads["torch"]) == 21 and grads["plait"].keys() == grads["torch"].keys()
    for fqn, theirs in grads["torch"].items():
        for ours, value in zip(grads["plait"][fqn], theirs):
            assert abs(ours - value) <= 1e-6 * abs(value), (fqn, grads["plait"][fqn], theirs)
    sums = {lib: _numbers(out, "sum") for lib, out in outs.items()}
    assert len(sums["torch"]) == 4 * 10
    _assert_close(sums["plait"], sums["torch"])


def _driven(lib: str, cwd: Path, ranks: int, runs: list[tuple[str, Path, list[str]]]) -> list[dict]:
    """Each run (folder, script, args) in order, as its own fork of one launch of
    tests/readme_driver.py (a fork finalizes as a fresh interpreter; torch is imported once per
    rank, not once per run); -> each run's losses, (rank, step) -> loss. A rank's lines come in
    order, and the driver prints "README example NAME: rank R exit 0" after each of its runs,
    so a rank's loss lines belong to the run of as many of its exit lines as came before."""
    specs = ["::".join([name, str(script), *args]) for name, script, args in runs]
    out = _launch(lib, DRIVER, cwd, ranks, *specs)
    losses: list[dict] = [{} for _ in runs]
    exits = dict.fromkeys(range(ranks), 0)
    for line in out.splitlines():
        if m := re.search(r"README example \S+: rank (\d+) exit (-?\d+)", line):
            assert m[2] == "0", out[-4000:]
            exits[int(m[1])] += 1
        elif m := re.search(rf"rank (\d+) step (\d+) loss {NUMBER}", line):
            losses[exits[int(m[1])]][int(m[1]), int(m[2])] = float(m[3])
    assert exits == dict.fromkeys(range(ranks), len(runs)), out[-4000:]
    return losses


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory) -> dict:
    """Both APIs' train-then-resume runs, plait's and torch's, and plait's uninterrupted run:
    one launch per library (plait's and torch's side by side), each run a fork of it.

    lib -> api -> (the two runs' losses, the folder they ran in); "uninterrupted" -> plait's
    fsdp2 losses over 10 steps under --dcp-api, shared by both APIs' tests: the pretrained model
    loads to the same shards either way, so each API's resumed run must equal this one exactly."""
    cwd = tmp_path_factory.mktemp("fsdp2")
    scripts = _scripts(cwd, "fsdp2.py")
    apis = {"--dcp-api": ["--dcp-api"], "--dtensor-api": []}

    def runs(lib):  # per API: the first trains steps 0-4 and saves; the second finds checkpoints/<api>/5, resumes
        plan = [(f"{lib}_{api[2:]}", scripts[lib], flags) for api, flags in apis.items() for _ in range(2)]
        if lib == "plait":
            plan.append(("uninterrupted", scripts[lib], ["--dcp-api", "--steps", "10"]))
        return _driven(lib, cwd, 2, plan)

    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(scripts, pool.map(runs, scripts)))
    result = {lib: {api: ({**done[lib][2 * i], **done[lib][2 * i + 1]}, cwd / f"{lib}_{api[2:]}")
                    for i, api in enumerate(apis)} for lib in scripts}
    result["uninterrupted"] = done["plait"][4]
    return result


@pytest.mark.parametrize("api", ["--dcp-api", "--dtensor-api"])
def test_fsdp2_example_resumes_to_torchs_numbers(api, fsdp2_runs):
    (ours, our_dir), (theirs, their_dir) = fsdp2_runs["plait"][api], fsdp2_runs["torch"][api]
    assert sorted(theirs) == [(r, s) for r in range(2) for s in range(10)]
    _assert_close(ours, theirs)
    folder = "dcp_api" if api == "--dcp-api" else "dtensor_api"
    ours_sd, theirs_sd = (torch.load(d / "checkpoints" / folder / "10" / "model.pt") for d in (our_dir, their_dir))
    assert ours_sd.keys() == theirs_sd.keys()
    for fqn, value in theirs_sd.items():
        torch.testing.assert_close(ours_sd[fqn], value, rtol=1e-4, atol=1e-5, msg=lambda m, f=fqn: f"{f}: {m}")
    assert fsdp2_runs["uninterrupted"] == ours
