"""Every byte of a checkpoint is under a checksum: a flipped or cut byte anywhere fails load
(or, for bytes that no load reads, verify), naming the file, the tensor where there is one,
"is corrupt" and the previous complete checkpoint beside it. Plus torch's format utilities
and deprecated names.

One tiny checkpoint (two tensor files: thread_count=2) is saved once per module beside an
older one (step-000100, step-000150); each case copies both and damages a copy of step-000150.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint import format_utils, tools
from plait.checkpoint.metadata import METADATA_FILE
from plait.testing import run_distributed
from tests.checkpoint._states import full, laid_out, reference

FILES = ["__0_0.safetensors", "__0_1.safetensors"]  # w in one, b in the other (largest first)


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).bfloat16()},
            "step": 5}


def _empty():
    return {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}, "step": 0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    for step in (100, 150):
        dcp.save(_state(), storage_writer=dcp.FileSystemWriter(root / f"step-{step:06d}", thread_count=2))
    assert sorted(os.listdir(root / "step-000150")) == sorted([*FILES, METADATA_FILE])
    return root


@pytest.fixture
def run(saved, tmp_path):
    """A fresh copy of both checkpoints: damage tmp_path/run/step-000150 freely."""
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def _offset(path, file: str, part: str, where: str) -> tuple[int, str | None]:
    """The byte at `where` (start, middle, end) of `part` (header, data, all) of `file`, and
    the tensor whose bytes hold it (None: no single tensor)."""
    md = dcp.FileSystemReader(path).read_metadata()
    size = os.path.getsize(os.path.join(path, file))
    lo, hi = 0, size
    if part != "all":
        h = md.file_meta[file].header_nbytes
        lo, hi = (0, h) if part == "header" else (h, size)
    at = {"start": lo, "middle": (lo + hi) // 2, "end": hi - 1}[where]
    owner = [fqn for fqn, t in md.tensors.items() for c in t.chunks if c.file == file and c.begin <= at < c.begin + c.nbytes]
    return at, owner[0] if owner else None


def _flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))  # one bit


def _assert_named(message: str, file: str, fqn: str | None, path) -> None:
    assert file in message and f"checkpoint {path} is corrupt" in message, message
    assert "the previous complete checkpoint in" in message and "is step-000100" in message, message
    assert fqn is None or repr(fqn) in message, message


def _assert_verify_fails(path, file: str, capsys) -> None:
    assert tools.verify(str(path)) != []
    capsys.readouterr()
    assert tools.main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert file in err and f"checkpoint {path} is corrupt" in err and "is step-000100" in err, err


FLIPS = [(f, part, where) for f in FILES for part in ("header", "data") for where in ("start", "middle", "end")]
FLIPS += [(METADATA_FILE, "all", where) for where in ("start", "middle", "end")]


def test_checksums_are_zlib_crc32(saved):
    """zlib-ng's crc32 (when installed) gives zlib's values: checkpoints written either way,
    or before it, verify alike."""
    import zlib

    from plait.checkpoint.metadata import crc32

    data = os.urandom(1 << 16)
    assert crc32(data) == zlib.crc32(data) and crc32(data[7:], 12345) == zlib.crc32(data[7:], 12345)
    path = saved / "step-000150"
    md = dcp.FileSystemReader(path).read_metadata()
    for file in FILES:
        raw = (path / file).read_bytes()
        assert zlib.crc32(raw[:md.file_meta[file].header_nbytes]) == md.file_meta[file].header_crc32
        chunks = [c for t in md.tensors.values() for c in t.chunks if c.file == file]
        assert chunks and all(zlib.crc32(raw[c.begin:c.begin + c.nbytes]) == c.crc32 for c in chunks)
    text = (path / METADATA_FILE).read_text()
    head, trailer = text.rsplit(",\n \"metadata_crc32\"", 1)
    assert f"{zlib.crc32(head.encode()):08x}" in trailer


@pytest.mark.parametrize("file,part,where", FLIPS)
def test_flipped_byte_fails_load_and_verify(run, capsys, file, part, where):
    path = run / "step-000150"
    at, fqn = _offset(path, file, part, where)
    _flip(path / file, at)
    with pytest.raises(dcp.CorruptCheckpointError) as e:
        dcp.load(_empty(), checkpoint_id=path)
    _assert_named(str(e.value), file, fqn, path)
    _assert_verify_fails(path, file, capsys)


@pytest.mark.parametrize("file", [*FILES, METADATA_FILE])
@pytest.mark.parametrize("cut", ["last byte", "half", "one byte appended"])
def test_truncated_file_fails_load_and_verify(run, capsys, file, cut):
    path = run / "step-000150"
    size = os.path.getsize(path / file)
    os.truncate(path / file, {"last byte": size - 1, "half": size // 2, "one byte appended": size + 1}[cut])
    with pytest.raises(dcp.CorruptCheckpointError) as e:
        dcp.load(_empty(), checkpoint_id=path)
    _assert_named(str(e.value), file, None, path)
    _assert_verify_fails(path, file, capsys)


def test_bytes_no_load_reads_fail_verify(run, capsys):
    path = run / "step-000150"
    md = dcp.FileSystemReader(path).read_metadata()
    (b_file,) = {c.file for c in md.tensors["model.b"].chunks}
    _flip(path / b_file, 3)  # in the header of the file that only model.b lives in
    part = {"model": {"w": torch.zeros(6, 4)}}
    with pytest.warns(UserWarning, match="unexpected key 'model.b'"):  # reads only w's file: loads, w intact
        dcp.load(part, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(part["model"]["w"], _state()["model"]["w"])
    _assert_verify_fails(path, b_file, capsys)


def test_intact_and_no_previous(run, capsys):
    path = run / "step-000150"
    assert tools.main(["verify", str(path)]) == 0
    assert "every checksum matches" in capsys.readouterr().out
    shutil.rmtree(run / "step-000100")
    _flip(path / METADATA_FILE, 10)
    with pytest.raises(dcp.CorruptCheckpointError, match=f"there is no earlier complete checkpoint in {run}"):
        dcp.load(_empty(), checkpoint_id=path)


def test_version_1_checkpoint_still_loads(run, capsys):
    """A checkpoint saved before headers and metadata.json were checksummed: chunks only."""
    path = run / "step-000150"
    body = json.loads((path / METADATA_FILE).read_text())
    del body["file_meta"], body["metadata_crc32"]
    body["version"] = 1
    (path / METADATA_FILE).write_text(json.dumps(body, indent=1))
    state = _empty()
    dcp.load(state, checkpoint_id=path)
    assert torch.equal(state["model"]["w"], _state()["model"]["w"]) and state["step"] == 5
    assert tools.main(["verify", str(path)]) == 0
    assert "format version 1" in capsys.readouterr().out


def _save_world_2(path: str) -> None:
    dcp.save({"model": laid_out("S0", 2)}, checkpoint_id=path)


def _load_world_2(path: str) -> str:
    state = {"model": laid_out("S0", 2, zero=True)}
    try:
        dcp.load(state, checkpoint_id=path)
    except (dcp.CorruptCheckpointError, dcp.CheckpointError) as e:  # the failing rank's, or another's
        return str(e)
    return "loaded"


def test_world_2_every_rank_names_the_file(tmp_path):
    root = tmp_path / "run"
    for step in (100, 150):
        run_distributed(_save_world_2, str(root / f"step-{step:06d}"), world_size=2)
    path = root / "step-000150"
    _flip(path / "__1_0.safetensors", 8)  # the first byte of rank 1's header JSON
    for msg in run_distributed(_load_world_2, str(path), world_size=2):
        _assert_named(msg, "__1_0.safetensors", None, path)
    ok = {k: torch.zeros_like(v) for k, v in reference().items()}
    dcp.load({"model": ok}, checkpoint_id=root / "step-000100")  # the one the message names loads
    assert all(torch.equal(full(ok[k]).view(torch.uint8), v.view(torch.uint8)) for k, v in reference().items())


class Opaque:
    """Not a tensor or plain value: torch.load(weights_only=True) must refuse it."""


def test_format_utils_round_trip_and_refuse_objects(saved, tmp_path):
    src = saved / "step-000100"
    pt = tmp_path / "state.pt"
    format_utils.dcp_to_torch_save(src, pt)
    flat = torch.load(pt, weights_only=True)
    ref = _state()
    assert set(flat) == {"model.w", "model.b", "step"} and flat["step"] == 5
    assert torch.equal(flat["model.w"], ref["model"]["w"]) and flat["model.b"].dtype == torch.bfloat16
    format_utils.torch_save_to_dcp(pt, tmp_path / "back")
    state = _empty()
    dcp.load(state, checkpoint_id=tmp_path / "back")  # the same keys, so the nested state loads
    assert torch.equal(state["model"]["w"], ref["model"]["w"]) and torch.equal(state["model"]["b"], ref["model"]["b"])
    assert state["step"] == 5 and tools.verify(str(tmp_path / "back")) == []
    bad = tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2), "o": Opaque()}, bad)
    with pytest.raises(ValueError, match=r"(?s)weights_only=True.*Opaque"):
        format_utils.torch_save_to_dcp(bad, tmp_path / "never")
    assert not os.path.exists(tmp_path / "never")


def test_deprecated_names_warn_and_work(tmp_path):
    path = tmp_path / "old-api"
    with pytest.warns(FutureWarning, match="`save_state_dict` is deprecated"):
        md = dcp.save_state_dict(_state(), dcp.FileSystemWriter(path))
    assert set(md.tensors) == {"model.w", "model.b"}
    state = _empty()
    with pytest.warns(FutureWarning, match="`load_state_dict` is deprecated"):
        dcp.load_state_dict(state, dcp.FileSystemReader(path))
    assert torch.equal(state["model"]["w"], _state()["model"]["w"]) and state["step"] == 5
