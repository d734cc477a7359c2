"""Non-tensor items as torch's planners write them: torch.save'd bytes (BytesIO), kept exactly.

    TorchStyleSavePlanner: resolve_data of a value -> torch.save(value) into a BytesIO, as
        torch's DefaultSavePlanner does
    saved by plait's FileSystemWriter -> metadata.json {"$raw": base64} (under its crc32)
    a LoadPlanner's load_bytes receives the exact bytes saved (torch's contract)
    plait's DefaultLoadPlanner reads them only with torch.load(weights_only=True): a dict of
        ints and tensors loads; a pickled object of any other class is refused by name and its
        code never runs
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint.planner_api import WriteItemType

RAN = []  # a pickled _Evil's __reduce__ appends here when it is unpickled


class _Evil:
    def __reduce__(self):
        return (RAN.append, ("unpickled",))


class TorchStyleSavePlanner(dcp.DefaultSavePlanner):
    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.state_dict[write_item.index.fqn], buf)
            return buf
        return super().resolve_data(write_item)


class KeepBytesLoadPlanner(dcp.DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.got: dict[str, bytes] = {}

    def load_bytes(self, read_item, value):
        self.got[read_item.dest_index.fqn] = value.read()


def _saved_bytes(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_torch_save_bytes_round_trip_exactly(tmp_path):
    path = str(tmp_path / "c")
    dcp.save({"w": torch.ones(3), "epoch": 3, "name": "run"}, checkpoint_id=path, planner=TorchStyleSavePlanner(),
             no_dist=True)
    with open(os.path.join(path, "metadata.json")) as f:
        stored = json.load(f)["values"]
    assert set(stored) == {"epoch", "name"} and all(set(v) == {"$raw"} for v in stored.values()), stored
    keep = KeepBytesLoadPlanner()
    dcp.load({"w": torch.zeros(3), "epoch": 0, "name": ""}, checkpoint_id=path, planner=keep, no_dist=True)
    assert keep.got == {k: __import__("base64").b64decode(v["$raw"]) for k, v in stored.items()}  # exactly
    assert torch.load(io.BytesIO(keep.got["epoch"]), weights_only=True) == 3
    back = {"w": torch.zeros(3), "epoch": 0, "name": ""}
    dcp.load(back, checkpoint_id=path, no_dist=True)  # plait's planner: weights_only=True
    assert back == {"w": back["w"], "epoch": 3, "name": "run"} and torch.equal(back["w"], torch.ones(3))


def test_a_json_value_from_a_custom_planner_keeps_its_exact_bytes(tmp_path):
    """Bytes that parse as JSON but would not be re-encoded identically are kept raw."""
    class Spaced(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return io.BytesIO(b'{ "a" :1}')
            return super().resolve_data(write_item)

    path = str(tmp_path / "c")
    dcp.save({"v": 1}, checkpoint_id=path, planner=Spaced(), no_dist=True)
    keep = KeepBytesLoadPlanner()
    dcp.load({"v": None}, checkpoint_id=path, planner=keep, no_dist=True)
    assert keep.got["v"] == b'{ "a" :1}'


def test_plait_never_unpickles_an_arbitrary_object(tmp_path):
    path = str(tmp_path / "c")
    planner = TorchStyleSavePlanner()
    dcp.save({"evil": 1}, checkpoint_id=path, planner=planner, no_dist=True)
    # swap in the bytes of an object whose unpickling runs code; the metadata's crc32 is redone
    md_path = os.path.join(path, "metadata.json")
    md = dcp.FileSystemReader(path).read_metadata()
    md.values["evil"] = {"$raw": __import__("base64").b64encode(_saved_bytes(_Evil())).decode()}
    with open(md_path, "w") as f:
        f.write(md.to_json())
    with pytest.raises(ValueError, match=r"state_dict\['evil'\] was saved as .* raw bytes .*weights_only=True"):
        dcp.load({"evil": None}, checkpoint_id=path, no_dist=True)
    assert RAN == []
    keep = KeepBytesLoadPlanner()  # a planner that wants the bytes gets them, unread
    dcp.load({"evil": None}, checkpoint_id=path, planner=keep, no_dist=True)
    assert keep.got["evil"] == _saved_bytes(_Evil()) and RAN == []


def test_verify_covers_raw_bytes(tmp_path):
    from plait.checkpoint.tools import main as cli

    path = str(tmp_path / "c")
    dcp.save({"x": 1}, checkpoint_id=path, planner=TorchStyleSavePlanner(), no_dist=True)
    md_path = os.path.join(path, "metadata.json")
    data = bytearray(open(md_path, "rb").read())
    at = data.index(b'"$raw"') + 12  # a byte inside the base64 of the raw bytes
    data[at] ^= 0x01
    open(md_path, "wb").write(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError, match="metadata.json"):
        dcp.load({"x": None}, checkpoint_id=path, no_dist=True)
    assert cli(["verify", path]) != 0
