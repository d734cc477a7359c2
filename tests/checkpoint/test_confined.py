"""A checkpoint's files stay inside its folder: metadata.json (its checksum recomputed, as a
crafted one would have it) or a torch DCP .metadata naming a path, a link out of the folder or
a FIFO is refused naming the entry, by load, verify, consolidate, inspect and import-torch-dcp;
nothing outside is read, no size or checksum of it printed, nothing hangs.
"""

from __future__ import annotations

import json
import os
import pickle
import signal

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint import tools
from tests.checkpoint._crafted import empty, read_body, reference, save, write_body

SECRET = b"the secret bytes outside the checkpoint folder"


@pytest.fixture
def saved(tmp_path):
    (tmp_path / "secret.txt").write_bytes(SECRET)
    path = str(tmp_path / "run" / "ckpt")
    os.makedirs(os.path.dirname(path))
    save(path)
    return path


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks (a FIFO opened for reading) fails the test instead of hanging it."""
    def stop(*_):
        raise TimeoutError("blocked for 10 s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _all_refuse(path: str, entry: str, capsys, *, metadata: bool = True) -> None:
    """load, verify, consolidate and inspect each fail naming `entry` (inspect, which opens no
    tensor file, only for an entry of metadata.json); no output shows the secret's size or checksum."""
    import zlib

    with pytest.raises(dcp.CorruptCheckpointError) as e:
        dcp.load(empty(), checkpoint_id=path)
    assert entry in str(e.value), str(e.value)
    problems = tools.verify(path)
    assert problems and any(entry in p for p in problems), problems
    capsys.readouterr()
    out = os.path.join(os.path.dirname(path), "out.safetensors")
    assert [tools.main(["verify", path]), tools.main(["consolidate", path, out]),
            tools.main(["inspect", path])] == [1, 1, 1 if metadata else 0]
    said = capsys.readouterr()
    text = said.out + said.err
    assert entry in text and not os.path.exists(out)
    for leak in (str(len(SECRET)), f"{zlib.crc32(SECRET[:1]):#010x}", f"{zlib.crc32(SECRET):#010x}"):
        assert leak not in text, (leak, text)


@pytest.mark.parametrize("name", ["../../secret.txt", "SECRET_ABS", "sub/../../../secret.txt", "..", ""])
def test_a_chunk_naming_a_path_is_refused(saved, capsys, name):
    name = os.path.join(os.path.dirname(os.path.dirname(saved)), "secret.txt") if name == "SECRET_ABS" else name
    body = read_body(saved)
    c = body["tensors"]["w"]["chunks"][1]
    c["file"], c["begin"], c["nbytes"] = name, 0, 16  # a 1-byte chunk would print the crc32 of one byte
    body["tensors"]["w"]["chunks"][1]["sizes"] = [1, 4]
    write_body(saved, body)
    _all_refuse(saved, f"names the file {name!r}", capsys)


def test_files_and_file_meta_names_are_refused(saved, capsys):
    body = read_body(saved)
    body["files"].append("/etc/passwd")
    write_body(saved, body)
    _all_refuse(saved, "'/etc/passwd'", capsys)


@pytest.mark.parametrize("kind", ["link out", "link in", "fifo", "directory"])
def test_a_file_that_is_a_link_a_fifo_or_a_directory_is_refused(saved, capsys, tmp_path, kind):
    file = dcp.FileSystemReader(saved).read_metadata().tensors["w"].chunks[0].file
    target = os.path.join(saved, file)
    moved = str(tmp_path / "moved.safetensors") if kind == "link out" else os.path.join(saved, "real.safetensors")
    os.rename(target, moved)
    if kind.startswith("link"):
        os.symlink(moved, target)
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        os.mkdir(target)
    what = {"link out": "is a symbolic link", "link in": "is a symbolic link", "fifo": "is a FIFO",
            "directory": "is a directory"}[kind]
    _all_refuse(saved, what, capsys, metadata=False)


def test_metadata_json_that_is_a_link_is_refused(saved, tmp_path):
    outside = tmp_path / "other.json"
    os.rename(os.path.join(saved, "metadata.json"), outside)
    os.symlink(outside, os.path.join(saved, "metadata.json"))
    with pytest.raises(dcp.CorruptCheckpointError, match="metadata.json .* is a symbolic link"):
        dcp.load(empty(), checkpoint_id=saved)
    assert tools.main(["verify", saved]) == 1


def test_intact_crafted_checkpoint_loads(saved):
    """The base of these cases is sound: w from two chunks."""
    state = empty()
    dcp.load(state, checkpoint_id=saved)
    ref = reference()
    assert torch.equal(state["w"], ref["w"]) and torch.equal(state["s"], ref["s"]) and state["step"] == 5
    assert tools.verify(saved) == []


def _torch_dcp(path: str) -> None:
    import torch.distributed.checkpoint as torch_dcp

    torch_dcp.save({"w": torch.arange(6.0)}, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize("relative_path", ["../secret.txt", "SECRET_ABS", "fifo"])
def test_import_torch_dcp_refuses_files_outside_or_not_regular(tmp_path, relative_path):
    (tmp_path / "secret.txt").write_bytes(SECRET)
    src = tmp_path / "dcp"
    _torch_dcp(str(src))
    os.mkfifo(src / "fifo")
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written by torch just now
    name = str(tmp_path / "secret.txt") if relative_path == "SECRET_ABS" else relative_path
    for info in md.storage_data.values():
        info.relative_path, info.offset, info.length = name, 0, len(SECRET)
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    out = tmp_path / "out"
    with pytest.raises(dcp.CorruptCheckpointError, match=r"storage entry for 'w' .*(names the file|is a FIFO)"):
        from plait.checkpoint.dcp_import import import_torch_dcp
        import_torch_dcp(str(src), str(out))
    assert tools.main(["import-torch-dcp", str(src), str(out)]) == 1
    assert not out.exists() and not (tmp_path / "out.incomplete").exists()


@pytest.mark.parametrize("bad", ["../secret.safetensors", "link"])
def test_hugging_face_index_naming_a_file_outside_is_refused(tmp_path, bad):
    hf = tmp_path / "hf"
    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.HuggingFaceStorageWriter(str(hf)), no_dist=True)
    index = hf / "model.safetensors.index.json"
    if not index.exists():  # one file, no index: write the index a sharded save has
        index.write_text('{"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    real = json.loads(index.read_text())["weight_map"]["w"]
    os.rename(hf / real, tmp_path / "secret.safetensors")
    if bad == "link":
        os.symlink(tmp_path / "secret.safetensors", hf / "link")
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": bad}}))
    said = "names the file '../secret.safetensors'" if bad != "link" else "is a symbolic link"
    with pytest.raises(dcp.CheckpointException, match=said):  # a storage layer's error, as torch wraps it
        dcp.load({"w": torch.zeros(6)}, storage_reader=dcp.HuggingFaceStorageReader(str(hf)), no_dist=True)
