"""parallelize_module's plan: wildcards, the module itself, the default mesh, and every
error, each raised before anything is applied or sent.

    an entry matching no submodule      ValueError naming the entry and the closest FQNs
    a style on a module it can't shard  TypeError (also NotImplementedError, as torch) naming both
    a mesh that is not 1-D              ValueError naming its shape
    an input DTensor whose placements   ValueError naming both layouts
      disagree with the declared layout
    a sequence not divisible by tp      ValueError at the first local output, before the
      under sequence parallel           reduce-scatter is sent
"""

import pytest
import torch
from torch import nn

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from plait.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from plait.tensor.parallel.api import fqn_matches, resolve_plan
from plait.testing import distributed

from ._block import Block, make_block, parallel_block


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))


def test_fqn_patterns():
    assert fqn_matches("layers.*.feed_forward.w1", "layers.10.feed_forward.w1")
    assert not fqn_matches("layers.*.feed_forward.w1", "layers.1.feed_forward.w2")
    assert not fqn_matches("layers.*", "layers.1.feed_forward")  # one token per *
    assert fqn_matches("attention.w[qkv]", "attention.wk") and fqn_matches("", "")
    hits = resolve_plan(Stack(), {"layers.*.feed_forward.w1": ColwiseParallel(), "layers.1": SequenceParallel()})
    assert [fqn for fqn, _, _ in hits] == [f"layers.{i}.feed_forward.w1" for i in range(3)] + ["layers.1"]


def test_plan_errors_without_processes():
    with pytest.raises(ValueError, match=r"'layers\.\*\.feed_forward\.w4' matches no submodule.*'layers\.\*\.feed_forward\.w1'"):
        resolve_plan(Stack(), {"layers.*.feed_forward.w4": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'atention\.wq'.*closest: \['attention\.wq'"):
        resolve_plan(Block(), {"atention.wq": ColwiseParallel()})
    with pytest.raises(TypeError, match="'attention' maps to str, not a ParallelStyle"):
        resolve_plan(Block(), {"attention": "colwise"})
    with pytest.raises(ValueError, match="2 input_layouts .* but 1 desired_input_layouts"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=Replicate())
    with pytest.raises(ValueError, match="no desired_input_layouts"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(ValueError, match="name the same kwargs"):
        PrepareModuleInput(input_kwarg_layouts={"mask": Shard(0)}, desired_input_kwarg_layouts={"bias": Replicate()})
    with pytest.raises(ValueError, match="give one per output"):
        PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=Replicate())
    with pytest.raises(TypeError, match="not a Placement"):
        PrepareModuleInput(input_layouts=("Shard(0)",), desired_input_layouts=(None,))


@distributed([2])
def test_wildcards_whole_module_and_default_mesh():
    mesh = init_device_mesh("cpu", (2,))
    stack = parallelize_module(Stack(), mesh, {"layers.*.feed_forward.w1": ColwiseParallel(),
                                               "layers.*.feed_forward.w2": RowwiseParallel()})
    for layer in stack.layers:
        assert layer.feed_forward.w1.weight.placements == (Shard(0),)
        assert layer.feed_forward.w2.weight.placements == (Shard(1),)
        assert not isinstance(layer.feed_forward.w3.weight, DTensor)
    linear = parallelize_module(nn.Linear(4, 6), None, ColwiseParallel())  # the style on the module itself
    assert linear.weight.device_mesh.shape == (2,) and linear.weight.placements == (Shard(0),)
    with pytest.warns(UserWarning, match="no parallelize_plan"):
        parallelize_module(nn.Linear(4, 6), mesh)


@distributed([2])
def test_errors_before_anything_is_applied():
    mesh = init_device_mesh("cpu", (2,))
    block = Block()
    plan = {"attention.wq": ColwiseParallel(), "attention_norm": ColwiseParallel()}
    with CommDebugMode() as mode:
        with pytest.raises(TypeError, match="ColwiseParallel shards nn.Linear and nn.Embedding, but "
                                            "attention_norm is a RMSNorm") as err:
            parallelize_module(block, mesh, plan)
        with pytest.raises(ValueError, match="matches no submodule"):
            parallelize_module(block, mesh, {"attention.wq": ColwiseParallel(), "attention.wz": RowwiseParallel()})
    assert isinstance(err.value, NotImplementedError)  # what torch raises, still caught
    assert mode.get_total_counts() == 0 and not isinstance(block.attention.wq.weight, DTensor)
    square = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"1-D device mesh, got one of shape \(2, 1\)"):
        parallelize_module(block, square, plan)
    parallelize_module(block, square["dp"], {"attention.wq": ColwiseParallel()})  # a slice is fine


@distributed([2])
def test_input_layout_mismatch_is_an_error():
    mesh = init_device_mesh("cpu", (2,))
    linear = parallelize_module(nn.Linear(4, 6), mesh, ColwiseParallel())
    x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    with CommDebugMode() as mode, pytest.raises(ValueError, match=r"placements \[Shard\(dim=0\)\], but the plan "
                                                                  r"declares its layout as Replicate\(\)"):
        linear(x)
    assert mode.get_total_counts() == 0
    linear(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))  # the declared layout is accepted
    prep = parallelize_module(nn.Identity(), mesh, PrepareModuleInput(input_layouts=Shard(1),
                                                                      desired_input_layouts=Replicate()))
    with pytest.raises(ValueError, match=r"input 0 of Identity is a DTensor with placements \[Replicate\(\)\]"):
        prep(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="got 2 positional inputs"):
        prep(torch.randn(4, 4), torch.randn(4, 4))
    out = parallelize_module(nn.Identity(), mesh, PrepareModuleOutput(output_layouts=Shard(0),
                                                                      desired_output_layouts=Replicate()))
    with pytest.raises(ValueError, match="output 0 of Identity is a DTensor"):
        out(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))


@distributed([2])
def test_uneven_sequence_under_sp_is_an_error_before_the_reduce_scatter():
    mesh = init_device_mesh("cpu", (2,))
    block = parallel_block(make_block(), mesh, sp=True)
    x = distribute_tensor(torch.randn(2, 7, 12), mesh, [Shard(1)])  # 7 positions: 4 and 3
    with CommDebugMode() as mode, pytest.raises(
            ValueError, match=r"output of RowwiseParallel Linear is Shard\(1\) of size 7, which does not divide by "
                              r"the mesh size 2"):
        block(x)
    assert "reduce_scatter" not in mode.get_comm_counts()


@pytest.mark.parametrize("name", ["ColwiseParallel", "RowwiseParallel", "SequenceParallel"])
def test_a_new_style_reads_as_torchs_does(name):
    """Scripts read a style's layouts before applying it (torchtitan does): the defaults a
    constructed style holds are torch's, placement for placement."""
    import torch.distributed.tensor.parallel as torch_tp

    ours, theirs = getattr(__import__("plait.tensor.parallel", fromlist=[name]), name)(), getattr(torch_tp, name)()
    for attr in ("input_layouts", "output_layouts", "desired_input_layouts", "sequence_sharding",
                 "use_local_output"):
        if hasattr(theirs, attr):
            assert repr(getattr(ours, attr)) == repr(getattr(theirs, attr)), attr
