"""Hugging Face layout: FSDP world 4 <-> one process, and TP boxes, through
HuggingFaceStorageWriter / HuggingFaceStorageReader; the files open with the `safetensors`
package and with torch's HuggingFaceStorageReader, and the index lists every tensor once.
Every comparison is bitwise (torch.equal): the layout moves bytes and must not change one.
"""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest
import torch
from safetensors import safe_open

import plait.checkpoint as dcp
from plait.checkpoint.hf_storage import INDEX_FILE, box_runs
from plait.tensor import DTensor
from plait.testing import run_distributed
from tests.checkpoint._layouts import build, lay_out, plain
from tests.checkpoint._states import full, laid_out, reference

# torch's DCP run in one process (to compare) warns that it assumes one process: torch's, expected
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def model_ref() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build(seed=0).state_dict().items()}


def open_layout(path: str) -> tuple[dict[str, str], dict[str, torch.Tensor], list[str]]:
    """(weight_map, every tensor read by safetensors, every file's tensor names in order)."""
    with open(os.path.join(path, INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    tensors, names = {}, []
    for name in sorted(set(weight_map.values())):
        with safe_open(os.path.join(path, name), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                names.append(k)
                tensors[k] = fh.get_tensor(k)
    return weight_map, tensors, names


def _save_fsdp(path: str, max_shard_size: int | None) -> bool:
    model = lay_out(build(seed=0), "fsdp")
    sd = model.state_dict()
    assert all(isinstance(sd[n], DTensor) for n, _ in model.named_parameters())  # sharded, not gathered
    dcp.save(sd, storage_writer=dcp.HuggingFaceStorageWriter(path, max_shard_size=max_shard_size))
    return True


def _load_fsdp(path: str) -> bool:
    model = lay_out(build(seed=1), "fsdp")
    sd = model.state_dict()
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(path))
    ref = model_ref()
    return all(torch.equal(plain(v), ref[k]) for k, v in sd.items())


def test_fsdp4_saves_hf_layout_that_one_process_and_torch_read(tmp_path):
    path = str(tmp_path / "hf")
    assert run_distributed(_save_fsdp, path, 200, world_size=4) == [True] * 4
    ref = model_ref()
    weight_map, tensors, names = open_layout(path)
    files = sorted(set(weight_map.values()))
    assert len(files) > 1 and files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    assert sorted(names) == sorted(ref) and set(weight_map) == set(ref)  # every tensor once
    assert all(torch.equal(tensors[k], v) for k, v in ref.items())
    for k in ref:  # the size limit: a file past 200 bytes holds one tensor only
        members = [n for n, f in weight_map.items() if f == weight_map[k]]
        assert len(members) == 1 or sum(ref[n].numel() * ref[n].element_size() for n in members) <= 200
    one = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(one, storage_reader=dcp.HuggingFaceStorageReader(path))
    assert all(torch.equal(one[k], v) for k, v in ref.items())
    import torch.distributed.checkpoint as tdcp

    theirs = {k: torch.zeros_like(v) for k, v in ref.items()}
    tdcp.load(theirs, storage_reader=tdcp.HuggingFaceStorageReader(path), no_dist=True)
    assert all(torch.equal(theirs[k], v) for k, v in ref.items())


def test_one_process_saves_hf_layout_that_fsdp4_reads(tmp_path):
    path = str(tmp_path / "hf")
    dcp.save(build(seed=0).state_dict(), storage_writer=dcp.HuggingFaceStorageWriter(path))
    weight_map, _, _ = open_layout(path)
    assert set(weight_map.values()) == {"model-00001-of-00001.safetensors"}  # no limit: one file
    assert run_distributed(_load_fsdp, path, world_size=4) == [True] * 4


def _tp_boxes(path: str) -> bool:
    dcp.save({k: v for k, v in laid_out("S0xS1", 4).items()}, storage_writer=dcp.HuggingFaceStorageWriter(path))
    back = laid_out("RxS0", 4, zero=True)
    dcp.load(back, storage_reader=dcp.HuggingFaceStorageReader(path))
    ref = reference()
    return all(torch.equal(full(v).view(torch.uint8), ref[k].view(torch.uint8)) for k, v in back.items())


def test_shard1_boxes_written_in_place_and_read_by_range(tmp_path):
    """S0xS1 on a 2x2 mesh: each rank's box is a row-and-column block (one run per row)."""
    path = str(tmp_path / "hf")
    assert run_distributed(_tp_boxes, path, world_size=4) == [True] * 4
    _, tensors, _ = open_layout(path)
    for k, v in reference().items():
        assert torch.equal(tensors[k].view(torch.uint8), v.view(torch.uint8)), k


def test_torch_hf_writer_output_reads_into_plait(tmp_path):
    import torch.distributed.checkpoint as tdcp

    ref = model_ref()
    tdcp.save(ref, storage_writer=tdcp.HuggingFaceStorageWriter(str(tmp_path)), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(back, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
    assert all(torch.equal(back[k], v) for k, v in ref.items())


def test_fqn_to_index_mapping_places_each_tensor(tmp_path):
    ref = model_ref()
    mapping = {k: 1 + (i % 2) for i, k in enumerate(ref)}
    dcp.save(ref, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), fqn_to_index_mapping=mapping))
    weight_map, tensors, _ = open_layout(str(tmp_path))
    assert weight_map == {k: f"model-{i:05d}-of-00002.safetensors" for k, i in mapping.items()}
    assert all(torch.equal(tensors[k], v) for k, v in ref.items())


def test_non_tensor_value_refused_by_name(tmp_path):
    with pytest.raises(dcp.CheckpointException, match="'step'.*tensors only"):
        dcp.save({"w": torch.ones(2), "step": 3}, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path)))
    assert not os.path.exists(tmp_path / INDEX_FILE)


def test_box_runs_cover_exactly_the_box():
    rng = random.Random(0)
    for _ in range(200):
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        offsets = [rng.randint(0, s - 1) for s in shape]
        sizes = [rng.randint(0, s - o) for s, o in zip(shape, offsets)]
        flat = torch.arange(torch.Size(shape).numel()).view(shape)
        box = flat[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
        runs = list(itertools.chain.from_iterable(range(a, a + n) for a, n in box_runs(shape, offsets, sizes)))
        assert runs == box.tolist(), (shape, offsets, sizes)


def _shard_files_both(path: str) -> list[str]:
    """torch's and plait's save_distributed=True (no consolidation) of the same Shard(0) state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    ref = model_ref()
    mesh = torch_mesh("cpu", (dist.get_world_size(),))
    theirs = {k: torch_distribute(v, mesh, [TorchShard(0)]) for k, v in ref.items()}
    tdcp.save(theirs, storage_writer=tdcp.HuggingFaceStorageWriter(os.path.join(path, "torch"), save_distributed=True))
    from plait.device_mesh import init_device_mesh
    from plait.tensor import Shard, distribute_tensor

    our_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ours = {k: distribute_tensor(v, our_mesh, [Shard(0)]) for k, v in ref.items()}
    dcp.save(ours, storage_writer=dcp.HuggingFaceStorageWriter(os.path.join(path, "plait"), save_distributed=True,
                                                                thread_count=2))
    return sorted(os.listdir(os.path.join(path, "plait")))


def _sharding(path: str) -> dict[str, dict]:
    out = {}
    for name in os.listdir(path):
        with safe_open(os.path.join(path, name), framework="pt") as fh:
            out[name] = {k: (json.loads(fh.metadata()["DCP_SHARDING_INFO"])[k]["saved_offsets"],
                             list(fh.get_slice(k).get_shape())) for k in fh.keys()}  # noqa: SIM118
    return out


def test_save_distributed_writes_torchs_shard_files_each_reads_the_others(tmp_path):
    """torch's save_distributed=True, enable_consolidation=False: a file per rank, chunks at
    their saved offsets, no index; the same names and chunks as torch's, read both ways."""
    import torch.distributed.checkpoint as tdcp

    got = run_distributed(_shard_files_both, str(tmp_path), world_size=2)
    names = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert got == [names, names] and sorted(os.listdir(tmp_path / "torch")) == names  # no index either
    assert _sharding(str(tmp_path / "plait")) == _sharding(str(tmp_path / "torch"))
    ref = model_ref()
    for src in ("plait", "torch"):
        ours = {k: torch.zeros_like(v) for k, v in ref.items()}
        dcp.load(ours, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / src)))
        assert all(torch.equal(ours[k], v) for k, v in ref.items()), src
        theirs = {k: torch.zeros_like(v) for k, v in ref.items()}
        tdcp.load(theirs, storage_reader=tdcp.HuggingFaceStorageReader(str(tmp_path / src)), no_dist=True)
        assert all(torch.equal(theirs[k], v) for k, v in ref.items()), src


def _meets_another_thread(names: set[str], lock, barrier) -> None:
    """Record this thread's name; the first two plait-hf threads wait for each other, so two
    threads are proven to work at once however the machine schedules them (a single-threaded
    implementation breaks the barrier after its timeout and fails the test)."""
    import threading

    name = threading.current_thread().name
    with lock:
        first = name not in names
        names.add(name)
        wait = first and name.startswith("plait-hf") and sum(n.startswith("plait-hf") for n in names) <= 2
    if wait:
        barrier.wait()


def test_thread_count_writes_files_on_threads_and_the_same_bytes(tmp_path, monkeypatch):
    import threading

    ref = model_ref()
    writers: set[str] = set()
    lock, barrier = threading.Lock(), threading.Barrier(2, timeout=120)
    pwrite = os.pwrite

    def spy(fd, data, offset):
        _meets_another_thread(writers, lock, barrier)
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    dcp.save(ref, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path / "one"), max_shard_size=200))
    one = set(writers)
    writers.clear()
    dcp.save(ref, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path / "three"), max_shard_size=200,
                                                               thread_count=3))
    assert len(one) == 1 and len(writers) >= 2 and all(w.startswith("plait-hf") for w in writers), (one, writers)
    files = sorted(os.listdir(tmp_path / "one"))
    assert len(files) > 3 and files == sorted(os.listdir(tmp_path / "three"))
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes(), name


def test_save_distributed_refuses_max_shard_size():
    with pytest.raises(ValueError, match="max_shard_size"):
        dcp.HuggingFaceStorageWriter("x", save_distributed=True, max_shard_size=100)


def test_reader_thread_count_reads_files_on_threads(tmp_path):
    import threading

    ref = model_ref()
    dcp.save(ref, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), max_shard_size=200))
    readers: set[str] = set()
    lock, barrier = threading.Lock(), threading.Barrier(2, timeout=120)

    class Recording(dcp.DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            _meets_another_thread(readers, lock, barrier)
            return super().resolve_tensor(read_item)

    back = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(back, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path), thread_count=3), planner=Recording())
    assert len(readers) >= 2 and all(r.startswith("plait-hf") for r in readers), readers
    assert all(torch.equal(back[k], v) for k, v in ref.items())


def test_every_file_and_the_index_are_fsynced_once(tmp_path, monkeypatch):
    """Durability: each model file once (after every rank's writes), the index, then the
    directory holding its rename; sync_files=False: none."""
    synced: list[str] = []
    fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ref = model_ref()
    path = tmp_path / "hf"
    dcp.save(ref, storage_writer=dcp.HuggingFaceStorageWriter(str(path), max_shard_size=200))
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(files) > 2
    assert sorted(synced[:len(files)]) == [str(path / f) for f in files]
    assert synced[len(files):] == [str(path / (INDEX_FILE + ".tmp")), str(path)], synced
    synced.clear()
    dcp.save(ref, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path / "nosync"), sync_files=False))
    assert synced == []
