"""The planners' pure logic, without processes: over every placement combination on 1-D
and 2-D meshes and shapes no world size divides, the pieces the writers save tile each
tensor exactly once (dedup), and every rank's load plan covers its piece exactly once.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from plait.checkpoint.metadata import ChunkMeta
from plait.checkpoint.planner import _overlap, piece
from plait.tensor import Replicate, Shard

MESHES = [(2,), (3,), (4,), (2, 2), (2, 3)]
SHAPE = (7, 5)


def _placements(ndim_mesh):
    options = [Shard(0), Shard(1), Replicate()]
    return list(itertools.product(options, repeat=ndim_mesh))


def _saved(mesh, placements):
    """The chunks the writers of this layout save, each element counted in `hits`."""
    hits = torch.zeros(SHAPE, dtype=torch.int64)
    chunks = []
    for coordinate in itertools.product(*[range(n) for n in mesh]):
        sizes, offsets, writer = piece(SHAPE, placements, mesh, coordinate)
        if writer and math.prod(sizes):
            hits[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]] += 1
            chunks.append(ChunkMeta(list(offsets), list(sizes), "f", "n", 0, 0, 0))
    return hits, chunks


@pytest.mark.parametrize("mesh", MESHES)
def test_writers_tile_each_tensor_once(mesh):
    for placements in _placements(len(mesh)):
        hits, _ = _saved(mesh, placements)
        assert torch.equal(hits, torch.ones(SHAPE, dtype=torch.int64)), (mesh, placements)


@pytest.mark.parametrize("save_mesh,load_mesh", [((4,), (3,)), ((2, 2), (3,)), ((3,), (2, 3)), ((2, 3), (2, 2))])
def test_load_plan_covers_every_piece_once(save_mesh, load_mesh):
    for save_pl, load_pl in itertools.product(_placements(len(save_mesh)), _placements(len(load_mesh))):
        _, chunks = _saved(save_mesh, save_pl)
        for coordinate in itertools.product(*[range(n) for n in load_mesh]):
            sizes, offsets, _ = piece(SHAPE, load_pl, load_mesh, coordinate)
            hits = torch.zeros(sizes, dtype=torch.int64)
            for c in chunks:
                box = _overlap(offsets, sizes, c.offsets, c.sizes)
                if box:
                    (lo0, lo1), (n0, n1) = box
                    hits[lo0 - offsets[0]:lo0 - offsets[0] + n0, lo1 - offsets[1]:lo1 - offsets[1] + n1] += 1
            assert torch.equal(hits, torch.ones(sizes, dtype=torch.int64)), (save_pl, load_pl, coordinate)


def test_plan_codec_round_trips_the_flat_and_the_generic_forms():
    """WriteItem / ReadItem of plain parts travel flat ($wi / $ri), anything else tagged; a
    dict of str keys goes as a JSON object unless a key could be read as a tag."""
    import json

    from plait.checkpoint import planner_api as api
    from plait.checkpoint.plan_codec import from_wire, to_wire

    props = api.TensorProperties(torch.bfloat16, requires_grad=True)
    flat = api.WriteItem(api.MetadataIndex("w", (2, 0)), api.WriteItemType.SHARD, tensor_data=api.TensorWriteData(
        api.ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])), props, torch.Size([4, 3])))
    generic = api.WriteItem(api.MetadataIndex("w"), api.WriteItemType.TENSOR, tensor_data=api.TensorWriteData(
        api.ChunkStorageMetadata((0,), (3,)), props, torch.Size([3])))  # tuples, not Sizes: kept as tuples
    read = api.ReadItem(api.LoadItemType.TENSOR, api.MetadataIndex("w", (2, 0), 7), torch.Size([0, 1]),
                        api.MetadataIndex("w", (0, 0)), torch.Size([2, 1]), torch.Size([2, 2]))
    data = {"plain": {"a": 1}, "tag-like": {"$size": 3}, 5: "int key"}
    wired = to_wire([flat, generic, read, data])
    assert [next(iter(w)) for w in wired[:3]] == ["$wi", "$dc", "$ri"]
    assert wired[3] == {"$dict": [["plain", {"a": 1}], ["tag-like", {"$dict": [["$size", 3]]}], [5, "int key"]]}
    back = from_wire(json.loads(json.dumps(wired)))
    assert back == [flat, generic, read, data]
    assert type(back[1].tensor_data.chunk.offsets) is tuple and back[2].dest_index.index == 7


def test_plan_codec_write_results_travel_flat_only_with_plain_json_records():
    """WriteResult with a JSON record ($wr), its index's offsets a Size again; a record that
    needs tags (a tuple, a "$" key) takes the generic form and comes back equal."""
    import json

    from plait.checkpoint import planner_api as api
    from plait.checkpoint.plan_codec import from_wire, to_wire
    from plait.checkpoint.storage_api import WriteResult

    flat = WriteResult(api.MetadataIndex("w", (2, 0), 3), 24, {"chunk": {"offsets": [2, 0], "crc32": 7}, "n": None})
    value = WriteResult(api.MetadataIndex("step"), 1, {"value": 3.5})
    tagged = WriteResult(api.MetadataIndex("w", (0, 0)), 24, {"chunk": (1, 2)})
    dollar = WriteResult(api.MetadataIndex("w", (0, 0)), 24, {"$raw": "x"})
    wired = to_wire([flat, value, tagged, dollar])
    assert [next(iter(w)) for w in wired] == ["$wr", "$wr", "$dc", "$dc"]
    back = from_wire(json.loads(json.dumps(wired)))
    assert back == [flat, value, tagged, dollar]
    assert type(back[0].index.offset) is torch.Size and back[0].index.index == 3 and back[1].index.offset is None
    assert type(back[2].storage_data["chunk"]) is tuple
