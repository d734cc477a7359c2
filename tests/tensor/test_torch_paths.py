"""The private names and module paths that torch's tests and libraries import (issue 52's
group 8), each with torch's shape and meaning, compared with torch's own where it runs here."""

import importlib
import io

import pytest
import torch
import torch.distributed.checkpoint._extension as torch_ext
import torch.distributed.device_mesh as torch_mesh
import torch.distributed.tensor as torch_dt
import torch.distributed.tensor._utils as torch_utils
from torch import nn

from plait import comm
from plait.debug import CommDebugMode
from plait.tensor import Partial, Replicate, Shard
from plait.testing import distributed

from ._helpers import mesh_for


def test_composable_replicate_is_a_module_holding_the_function():
    module = importlib.import_module("plait._composable.replicate")
    from plait._composable import replicate
    from plait.ddp import replicate as ddp_replicate

    assert module.replicate is ddp_replicate and replicate is ddp_replicate


def test_dtensor_spec_module_and_tensor_meta():
    from plait.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

    assert TensorMeta._fields == ("shape", "stride", "dtype") and ShardOrderEntry._fields == ("tensor_dim", "mesh_dims")
    assert ShardOrderEntry(tensor_dim=0, mesh_dims=(1,)) == (0, (1,))

    class Mesh:  # the spec reads only the mesh's shape here
        shape = (2, 2)

    meta = TensorMeta(torch.Size([4, 6]), (6, 1), torch.float32)
    spec = DTensorSpec(Mesh(), (Shard(0), Shard(0)), tensor_meta=meta)
    assert spec.tensor_meta == meta and spec.shape == (4, 6) and spec.dtype == torch.float32
    assert spec.shard_order == (ShardOrderEntry(0, (0, 1)),)
    assert DTensorSpec(Mesh(), (Replicate(), Shard(1)), meta).shard_order == (ShardOrderEntry(1, (1,)),)
    with pytest.raises(ValueError, match="needs the global shape"):
        DTensorSpec(Mesh(), (Replicate(), Replicate()))


def test_normalize_dim_and_mask_partial():
    from plait.tensor._ops._embedding_ops import _MaskPartial
    from plait.tensor._ops.utils import normalize_dim

    assert [normalize_dim(d, 3) for d in (-3, -1, 0, 2)] == [0, 2, 0, 2]
    p = _MaskPartial(offset_shape=torch.Size([8, 4]), offset_dim=0)
    assert isinstance(p, Partial) and p.reduce_op == "sum" and p.is_partial()
    assert p == _MaskPartial(offset_shape=[8, 4], offset_dim=0) != _MaskPartial(offset_shape=[8, 4], offset_dim=1)
    assert p != Partial() and hash(p) == hash(_MaskPartial(offset_shape=[8, 4]))


@pytest.mark.parametrize("size", [0, 1, 5, 8])
@pytest.mark.parametrize("with_padding", [True, False])
def test_shard_split_tensor_matches_torch(size, with_padding):
    t = torch.arange(size * 3.0).view(size, 3)
    ours, our_pads = Shard(0)._split_tensor(t, 4, with_padding=with_padding)
    theirs, their_pads = torch_dt.Shard(0)._split_tensor(t, 4, with_padding=with_padding)
    assert our_pads == their_pads and len(ours) == len(theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_tensor_chunk_spec_from_tuple_and_dict():
    from plait.pipelining.microbatch import TensorChunkSpec

    assert TensorChunkSpec.from_tuple((0, 1)) == (TensorChunkSpec(0), TensorChunkSpec(1))
    assert TensorChunkSpec.from_dict({"x": 1}) == {"x": TensorChunkSpec(1)}


def test_checkpoint_extension_registry():
    from plait.checkpoint._extension import Extension, ExtensionRegistry, StreamTransformExtension

    assert set(torch_ext.__all__) <= set(importlib.import_module("plait.checkpoint._extension").__all__)

    class Rot13(StreamTransformExtension):  # a user's transform, as torch's tests write one
        @staticmethod
        def registry_name():
            return "stream.rot"

        @staticmethod
        def from_descriptor(version):
            assert version == "2"
            return Rot13()

        def get_descriptor(self):
            return "stream.rot/2"

        def transform_to(self, output):
            return output

        def transform_from(self, input):
            return io.BytesIO(input.read())

    registry = ExtensionRegistry()
    registry.register(Rot13)
    (ext,) = registry.from_descriptor_list([Rot13().get_descriptor()])
    assert isinstance(ext, Rot13) and isinstance(ext, Extension)
    assert ext.transform_from(io.BytesIO(b"abc")).read() == b"abc"
    with pytest.raises(ValueError, match="Unknown extension name='nope'"):
        registry.from_descriptor_list(["nope/1"])
    with pytest.raises(TypeError):
        StreamTransformExtension()  # abstract, as torch's


@distributed([2])
def test_local_shape_redistribute_local_and_shard_tensor_match_torch(world_size):
    from plait.tensor._api import _shard_tensor
    from plait.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from plait.tensor._redistribute import redistribute_local_tensor
    from plait.tensor._utils import compute_local_shape_and_global_offset

    mesh = mesh_for(world_size)
    reference = torch_mesh.init_device_mesh("cpu", (world_size,))
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        want = torch_utils.compute_local_shape_and_global_offset(
            (5, 3), reference, [torch_dt.Shard(p.dim) if isinstance(p, Shard) else torch_dt.Replicate()
                                for p in placements])
        assert compute_local_shape_and_global_offset((5, 3), mesh, placements) == tuple(map(tuple, want))
    full = torch.arange(15.0).view(5, 3)
    with CommDebugMode() as mode:
        dt = _shard_tensor(full, [Shard(0)], mesh)
    assert mode.get_total_counts() == 0
    assert torch.equal(dt.to_local(), full.chunk(2)[comm.global_rank()])
    meta = TensorMeta(full.shape, full.stride(), full.dtype)
    src = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
    dst = DTensorSpec(mesh, (Replicate(),), tensor_meta=meta)
    assert torch.equal(redistribute_local_tensor(dt.to_local(), src, dst), full)


class _Inner(nn.Module):
    def forward(self, x):
        return comm.autograd.all_reduce(x, group=comm.world_group())


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(x * 2)


@distributed([2])
def test_comm_module_counts_by_module_and_phase():
    model = _Outer()
    with CommDebugMode() as mode:
        model(torch.ones(2, requires_grad=True)).sum().backward()
    counts = mode.comm_module_counts
    fwd = sum(counts["Global"]["forward"].values())
    assert fwd == 1 and counts["_Outer.inner"]["forward"]["all_reduce"] == 1
    assert counts["_Outer"]["forward"][torch.ops.c10d_functional.all_reduce] == 1, "torch's keys count too"
    total = sum(sum(c.values()) for c in counts["Global"].values())
    assert total == mode.get_total_counts()
