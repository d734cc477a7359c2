"""torch's extension points: a planner and a storage layer written once, against torch's
interfaces, run unchanged on torch's DCP and on plait's (the import source is the parameter).

    RenamePlanner(DefaultSavePlanner)    torch's docstring example: prefix every key "foo_"
    FP16Planner(DefaultSavePlanner)      torch's docstring example: save float32 as float16
    CountingWriter(StorageWriter)        wraps FileSystemWriter, logs each call, counts bytes
    StripPrefixPlanner(DefaultLoadPlanner) loads "foo_" keys into the plain names, logs commits

Both implementations must call the storage layer in the same order, save the same keys and
load the same bytes; plait's also on 2 ranks with DTensors (the plans cross the wire as JSON)
and with a failing rank (CheckpointException on every rank, nothing committed).
"""

from __future__ import annotations

import functools
import os
import types

import pytest
import torch

from plait.testing import run_distributed
from tests.checkpoint._states import full, laid_out, reference

# torch's DCP run in one process (to compare) warns that it assumes one process: torch's, expected
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def source(name: str) -> types.SimpleNamespace:
    """The names a torch DCP extension imports, from torch's package or plait's."""
    if name == "torch":
        import torch.distributed.checkpoint as ns
        from torch.distributed.checkpoint.metadata import Metadata
        from torch.distributed.checkpoint.planner import WriteItemType
    else:  # the porting rule: torch.distributed.X -> plait.X
        import plait.checkpoint as ns
        from plait.checkpoint import Metadata
        from plait.checkpoint.planner import WriteItemType
    return types.SimpleNamespace(dcp=ns, Metadata=Metadata, WriteItemType=WriteItemType)


def classes(src: types.SimpleNamespace) -> types.SimpleNamespace:
    dcp = src.dcp
    class RenamePlanner(dcp.DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            super().set_up_planner({"foo_" + k: v for k, v in state_dict.items()}, storage_meta, is_coordinator)

    class FP16Planner(dcp.DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            for p in plan.items:
                if p.tensor_data is not None:
                    p.tensor_data.properties.dtype = torch.float16
            return plan

        def resolve_data(self, write_item):
            item = super().resolve_data(write_item)
            return item if write_item.type == src.WriteItemType.BYTE_IO else item.to(torch.float16)

    class CountingWriter(dcp.StorageWriter):
        def __init__(self, path, *, fail_on_rank=None):
            self.inner = dcp.FileSystemWriter(path)
            self.calls, self.bytes, self.items, self.fail_on_rank = [], 0, 0, fail_on_rank

        def reset(self, checkpoint_id=None):
            self.calls.append("reset")
            self.inner.reset(checkpoint_id)

        def storage_meta(self):
            self.calls.append("storage_meta")
            return self.inner.storage_meta()

        def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
            self.calls.append("set_up_storage_writer")
            self.rank = kwargs.get("rank", 0)
            self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

        def prepare_local_plan(self, plan):
            self.calls.append("prepare_local_plan")
            return self.inner.prepare_local_plan(plan)

        def prepare_global_plan(self, plans):
            self.calls.append("prepare_global_plan")
            return self.inner.prepare_global_plan(plans)

        def write_data(self, plan, planner):
            self.calls.append("write_data")
            if self.rank == self.fail_on_rank:
                raise OSError("disk full (injected)")
            fut = self.inner.write_data(plan, planner)
            results = fut.wait()
            self.bytes += sum(r.size_in_bytes for r in results)
            self.items += len(results)
            return fut

        def finish(self, metadata, results):
            self.calls.append("finish")
            self.inner.finish(metadata, results)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return dcp.FileSystemWriter.validate_checkpoint_id(checkpoint_id)

    class StripPrefixPlanner(dcp.DefaultLoadPlanner):
        committed: list[str]

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.committed = []
            super().set_up_planner({"foo_" + k: v for k, v in state_dict.items()}, metadata, is_coordinator)

        def commit_tensor(self, read_item, tensor):
            self.committed.append(read_item.dest_index.fqn)
            super().commit_tensor(read_item, tensor)

    return types.SimpleNamespace(**{c.__name__: c for c in (RenamePlanner, FP16Planner,
                                                            CountingWriter, StripPrefixPlanner)})


def state(zero: bool = False) -> dict:
    ref = reference()
    model = {k: (torch.zeros_like(v) if zero else v.clone()) for k, v in ref.items()}
    return {"model": model, "head": torch.zeros(3) if zero else torch.arange(3.0)}


def _save_rename_load(src_name: str, path: str) -> dict:
    src = source(src_name)
    c = classes(src)
    writer = c.CountingWriter(path)
    kw = {"no_dist": True}
    md = src.dcp.save(state(), storage_writer=writer, planner=c.RenamePlanner(), **kw)
    saved = sorted(md.state_dict_metadata)
    loaded = state(zero=True)
    planner = c.StripPrefixPlanner()
    src.dcp.load(loaded, checkpoint_id=path, planner=planner, **kw)
    return {"calls": writer.calls, "items": writer.items, "bytes": writer.bytes, "saved": saved,
            "loaded": loaded, "committed": sorted(planner.committed)}


def test_rename_planner_and_counting_writer_behave_as_on_torch(tmp_path):
    got = {name: _save_rename_load(name, str(tmp_path / name)) for name in ("torch", "plait")}
    want_keys = sorted(["foo_head", *("foo_model." + k for k in reference())])
    for name, g in got.items():
        assert g["saved"] == want_keys, name
        assert g["calls"] == ["storage_meta", "set_up_storage_writer", "prepare_local_plan",
                              "prepare_global_plan", "write_data", "finish"], name
        assert g["committed"] == want_keys, name
        for k, v in state()["model"].items():
            assert torch.equal(g["loaded"]["model"][k].view(torch.uint8), v.view(torch.uint8)), (name, k)
        assert torch.equal(g["loaded"]["head"], torch.arange(3.0)), name
    assert got["plait"]["items"] == got["torch"]["items"] == len(want_keys)
    # plait's results count the tensor bytes exactly; torch's add its serialization's framing
    nbytes = sum(v.numel() * v.element_size() for v in reference().values()) + 3 * 4
    assert got["plait"]["bytes"] == nbytes <= got["torch"]["bytes"]


@pytest.mark.parametrize("src_name", ["torch", "plait"])
def test_fp16_planner(tmp_path, src_name):
    src = source(src_name)
    c = classes(src)
    w = {"w": torch.linspace(-1, 1, 12).view(3, 4)}
    md = src.dcp.save(w, checkpoint_id=str(tmp_path / "fp16"), planner=c.FP16Planner(), no_dist=True)
    assert isinstance(md, src.Metadata) and md.state_dict_metadata["w"].properties.dtype == torch.float16
    half = {"w": torch.zeros(3, 4, dtype=torch.float16)}
    src.dcp.load(half, checkpoint_id=str(tmp_path / "fp16"), no_dist=True)
    assert torch.equal(half["w"], w["w"].half())


def _distributed(path: str, fail_on_rank: int | None) -> dict:
    from plait import comm

    dcp = source("plait").dcp
    c = classes(source("plait"))
    writer = c.CountingWriter(path, fail_on_rank=fail_on_rank)
    try:
        dcp.save({"model": laid_out("S0", 2)}, storage_writer=writer, planner=c.RenamePlanner())
    except dcp.CheckpointException as e:
        return {"failed": sorted(e.failures), "committed": os.path.exists(path)}
    from plait.checkpoint import tools

    tools_ok = tools.main(["verify", path]) == 0 and "[Shard(dim=0)]" in tools.inspect(path)
    loaded = {"foo_model": laid_out("S1", 2, zero=True)}
    dcp.load(loaded, checkpoint_id=path)
    total = torch.tensor([writer.bytes])
    comm.all_reduce(total, group=comm.world_group())
    ref = reference()
    return {"bytes": int(total), "calls": writer.calls, "tools_ok": tools_ok,
            "equal": all(torch.equal(full(v).view(torch.uint8), ref[k].view(torch.uint8))
                         for k, v in loaded["foo_model"].items())}


def test_custom_planner_and_writer_on_two_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    got = run_distributed(_distributed, path, None, world_size=2)
    nbytes = sum(v.numel() * v.element_size() for v in reference().values())
    assert [g["equal"] for g in got] == [True, True]
    assert [g["tools_ok"] for g in got] == [True, True]  # verify passes, inspect shows the saved layout
    assert got[0]["bytes"] == nbytes  # every chunk written once, across the ranks
    assert "finish" in got[0]["calls"] and "finish" not in got[1]["calls"]  # the coordinator's alone


def test_a_failing_rank_raises_checkpoint_exception_everywhere(tmp_path):
    path = str(tmp_path / "ckpt")
    got = run_distributed(_distributed, path, 1, world_size=2)
    assert got == [{"failed": [1], "committed": False}] * 2


def test_async_save_refuses_a_custom_planner(tmp_path):
    c = classes(source("plait"))
    with pytest.raises(TypeError, match="async_save drives plait's DefaultSavePlanner.*use save"):
        source("plait").dcp.async_save(state(), checkpoint_id=str(tmp_path / "c"), planner=c.RenamePlanner())


def _global_plan_fails(path: str) -> list[int]:
    dcp = source("plait").dcp

    class Refuses(dcp.DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            raise ValueError(f"refused {len(all_plans)} plans")

    try:
        dcp.save({"model": laid_out("S0", 3)}, checkpoint_id=path, planner=Refuses())
    except dcp.CheckpointException as e:
        assert "refused 3 plans" in str(e), str(e)
        return sorted(e.failures)
    return []


def test_coordinator_failure_reaches_every_rank(tmp_path):
    """create_global_plan runs on the coordinator alone; its failure is scattered to all."""
    assert run_distributed(_global_plan_fails, str(tmp_path / "c"), world_size=3) == [[0]] * 3


def test_driven_load_still_checks_every_byte(tmp_path):
    """A custom LoadPlanner reads through read_data, which checks as read does."""
    dcp = source("plait").dcp
    path = str(tmp_path / "c")
    dcp.save(state(), checkpoint_id=path)
    name = os.path.join(path, "__0_0.safetensors")
    with open(name, "r+b") as f:  # the last byte: tensor data
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    class Custom(dcp.DefaultLoadPlanner):  # any subclass: driven through torch's protocol
        pass

    with pytest.raises(dcp.CheckpointException) as info:
        dcp.load(state(zero=True), checkpoint_id=path, planner=Custom())
    failure = info.value.failures[0]
    assert isinstance(failure, dcp.CorruptCheckpointError) and "__0_0.safetensors" in str(failure)


PROTOCOL = {"planner": ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan", "resolve_data"),
            "writer": ("storage_meta", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan",
                       "write_data", "finish"),
            "load planner": ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan",
                             "load_bytes", "resolve_tensor", "commit_tensor"),
            "reader": ("read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan",
                       "read_data")}


def _spy(method, name: str, calls: list[str], depth: list[int]):
    """Log `name` unless the planner or writer calls it from inside one of its own methods
    (torch's FileSystemWriter.finish calls its storage_meta), a run of one name once."""
    @functools.wraps(method)  # the signature stays the method's: both check for storage_meta / **kwargs
    def spy(*args, **kwargs):
        if depth[0] == 0 and (not calls or calls[-1] != name):
            calls.append(name)
        depth[0] += 1
        try:
            return method(*args, **kwargs)
        finally:
            depth[0] -= 1

    return spy


def _record_plain(src_name: str, path: str, monkeypatch, what: str) -> list[str]:
    """Plain save / load (state, checkpoint_id=path): the protocol calls the built-in planner
    and storage layer receive, in order (a run of one name, as resolve_data's, counted once)."""
    src = source(src_name)
    roles = ((("planner", src.dcp.DefaultSavePlanner), ("writer", src.dcp.FileSystemWriter)) if what == "save"
             else (("load planner", src.dcp.DefaultLoadPlanner), ("reader", src.dcp.FileSystemReader)))
    calls: list[str] = []
    for role, cls in roles:
        depth = [0]  # one per role: the planner's calls from inside write_data are the protocol's
        for name in PROTOCOL[role]:
            monkeypatch.setattr(cls, name, _spy(getattr(cls, name), f"{role}.{name}", calls, depth))
    if what == "save":
        src.dcp.save(state(), checkpoint_id=path, no_dist=True)
    else:
        src.dcp.load(state(zero=True), checkpoint_id=path, no_dist=True)
    monkeypatch.undo()
    return calls


def test_plain_save_takes_the_builtin_planner_and_writer_in_torchs_order(tmp_path, monkeypatch):
    got = {name: _record_plain(name, str(tmp_path / name), monkeypatch, "save") for name in ("torch", "plait")}
    assert got["plait"] == got["torch"] == [
        "writer.storage_meta", "planner.set_up_planner", "writer.set_up_storage_writer", "planner.create_local_plan",
        "writer.prepare_local_plan", "planner.create_global_plan", "writer.prepare_global_plan",
        "planner.finish_plan", "writer.write_data", "planner.resolve_data", "writer.finish"], got
    loaded = state(zero=True)
    source("plait").dcp.load(loaded, checkpoint_id=str(tmp_path / "plait"), no_dist=True)
    assert torch.equal(loaded["head"], torch.arange(3.0))
    assert all(torch.equal(loaded["model"][k].view(torch.uint8), v.view(torch.uint8))  # bitwise: NaNs too
               for k, v in state()["model"].items())


def test_plain_load_takes_the_builtin_planner_and_reader_in_torchs_order(tmp_path, monkeypatch):
    for name in ("torch", "plait"):
        source(name).dcp.save(state(), checkpoint_id=str(tmp_path / name), no_dist=True)
    got = {name: _record_plain(name, str(tmp_path / name), monkeypatch, "load") for name in ("torch", "plait")}
    # one box per tensor here: resolve_tensor and commit_tensor alternate, as many times as tensors
    boxes = ["load planner.resolve_tensor", "load planner.commit_tensor"] * (len(reference()) + 1)
    assert got["plait"] == got["torch"] == [
        "reader.read_metadata", "load planner.set_up_planner", "reader.set_up_storage_reader",
        "load planner.create_local_plan", "reader.prepare_local_plan", "load planner.create_global_plan",
        "reader.prepare_global_plan", "load planner.finish_plan", "reader.read_data", *boxes], got
