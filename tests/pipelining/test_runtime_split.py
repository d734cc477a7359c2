"""Splitting a model into stages, and a batch into microbatches: no processes needed.

pipeline() and split_model() cut by module name and keep fqns (the traced constructs are in
test_pipeline_trace.py); a batch that n_microbatches does not divide is an
error naming both numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.pipelining import (
    SplitPoint,
    TensorChunkSpec,
    merge_chunks,
    pipeline,
    split_args_kwargs_into_chunks,
    split_evenly,
    split_model,
    units,
)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.norm = nn.BatchNorm1d(8)  # has buffers forward updates
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Residual(Chain):
    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)  # residual: not what running the units in order computes
        return self.head(self.norm(h))


NAMES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]


def test_units_expand_containers_in_order():
    assert [n for n, _ in units(Chain())] == NAMES


def test_pipeline_cuts_where_split_spec_says_and_keeps_fqns():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(4, 3)
    pipe = pipeline(
        model, (x,), split_spec={"layers.1": SplitPoint.BEGINNING, "layers.3": SplitPoint.END}
    )
    assert pipe.num_stages == 3
    assert pipe.module_names_per_stage == [
        ["embed", "layers.0"],
        ["layers.1", "layers.2", "layers.3"],
        ["norm", "head"],
    ]
    stage1 = pipe.get_stage_module(1)
    assert sorted(stage1.state_dict()) == sorted(
        f"layers.{i}.0.{p}" for i in (1, 2, 3) for p in ("weight", "bias")
    )
    # shared, not copied
    assert stage1.get_submodule("layers.2.0").weight is model.layers[2][0].weight
    model.eval()
    h = x
    for s in range(3):
        h = pipe.get_stage_module(s)(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


def test_pipeline_leaves_buffers_and_rng_as_they_were():
    model = Chain()
    before = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(4, 3)
    rng = torch.get_rng_state()
    pipeline(model, (x,), split_spec={"norm": SplitPoint.BEGINNING})
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    assert torch.equal(torch.get_rng_state(), rng)


def test_pipeline_traces_a_forward_that_is_not_a_chain():
    """Residual adds between children: in the traced graph, so the split computes them."""
    model, x = Residual().eval(), torch.randn(4, 3)
    pipe = pipeline(model, (x,), split_spec={"layers.2": SplitPoint.BEGINNING})
    h = pipe.get_stage_module(0)(x)
    torch.testing.assert_close(pipe.get_stage_module(1)(h), model(x), rtol=0, atol=0)


def test_pipeline_names_a_bad_split_spec():
    with pytest.raises(ValueError, match="'layers.9', which is not a submodule of Chain"):
        pipeline(Chain(), (torch.randn(4, 3),), split_spec={"layers.9": SplitPoint.BEGINNING})
    with pytest.raises(TypeError, match="must be a SplitPoint"):
        pipeline(Chain(), (torch.randn(4, 3),), split_spec={"norm": "BEGINNING"})


def test_split_model_keeps_only_the_requested_stages_and_empties_the_model():
    model = Chain()
    per_stage = split_evenly(model, 4)
    assert per_stage == [
        ["embed", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "norm"],
        ["head"],
    ]
    weight = model.layers[1][0].weight
    first, third = split_model(model, per_stage, [0, 2])  # non-adjacent, as interleaving gives
    assert first.fqns == ["embed", "layers.0"] and third.fqns == ["layers.3", "norm"]
    assert "norm.running_mean" in third.state_dict()
    assert list(model.parameters()) == [], "the model must not keep any unit alive"
    assert all(weight is not p for m in (first, third) for p in m.parameters())


@pytest.mark.parametrize(
    "per_stage, message",
    [
        ([NAMES[:3], NAMES[4:]], r"units \['layers.2'\] are in no stage"),
        ([NAMES[:3], NAMES[2:]], "'layers.1' is in two stages"),
        ([NAMES[:2], ["layers.2", "layers.1", *NAMES[4:]]], "position 2 is 'layers.2'"),
        ([NAMES, ["extra"]], "'extra' is not a unit"),
        ([NAMES, []], "stage 1 has no units"),
    ],
)
def test_split_model_names_a_bad_assignment(per_stage, message):
    with pytest.raises(ValueError, match=message):
        split_model(Chain(), per_stage, 0)


def test_microbatches_split_and_merge_back():
    x, mask = torch.arange(24.0).view(8, 3), torch.arange(16).view(2, 8)
    arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(
        (x, "tag"), {"mask": mask}, 4, kwargs_chunk_spec={"mask": TensorChunkSpec(1)}
    )
    assert [a[0].shape for a in arg_mbs] == [(2, 3)] * 4 and arg_mbs[3][1] == "tag"
    assert torch.equal(kwarg_mbs[1]["mask"], mask[:, 2:4])
    assert torch.equal(merge_chunks([a[0] for a in arg_mbs]), x)
    assert torch.equal(
        merge_chunks([(a[0], torch.tensor(i)) for i, a in enumerate(arg_mbs)])[1], torch.arange(4)
    )


def test_batch_not_divisible_is_an_error_naming_both_numbers():
    with pytest.raises(
        ValueError, match=r"args\[0\]: batch size 10 .* not divisible by n_microbatches 4"
    ):
        split_args_kwargs_into_chunks((torch.zeros(10, 3),), None, 4)
