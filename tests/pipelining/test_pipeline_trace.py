"""pipeline() traces the model and cuts the graph: what torch's tracer splits, this splits.

Pure tests run the stage chain on one process and compare it with the model's own forward,
bit for bit (rtol=atol=0): the stages call the model's modules eagerly, in the same order,
so nothing but the split may differ. The distributed test trains PyTorch's pipelining
tutorial model split by pipeline() and split by hand, on 2 ranks, and compares the losses
bit for bit too (same modules, same schedule, same dropout seeds).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline
from plait.testing import distributed

BEGIN, END = SplitPoint.BEGINNING, SplitPoint.END


# --- PyTorch's "Introduction to Distributed Pipeline Parallelism" model, smaller ---------------


class Transformer(nn.Module):
    def __init__(self, dim: int = 32, n_layers: int = 8, n_heads: int = 4, vocab: int = 100):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        # A ModuleDict keeps the names when layers are deleted (the tutorial's manual split).
        self.layers = nn.ModuleDict()
        for layer_id in range(n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(dim, n_heads)
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        return self.output(h).clone() if self.output else h


def _chain(pipe, *args, **kwargs):
    out = pipe.get_stage_module(0)(*args, **kwargs)
    for s in range(1, pipe.num_stages):
        out = pipe.get_stage_module(s)(*(out if isinstance(out, tuple) else (out,)), **kwargs)
    return out


def _same(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tutorial_model_splits_at_layers_4_with_the_models_fqns():
    torch.manual_seed(0)
    model = Transformer().eval()
    x = torch.randint(0, 100, (2, 8))
    pipe = pipeline(module=model, mb_args=(x,), split_spec={"layers.4": BEGIN})
    assert pipe.num_stages == 2
    assert pipe.module_names_per_stage[1][0] == "layers.4"
    _same(_chain(pipe, x), model(x))
    full = model.state_dict()
    for s, layers in ((0, range(4)), (1, range(4, 8))):
        keys = set(pipe.get_stage_module(s).state_dict())
        assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {
            str(i) for i in layers
        }
        # a checkpoint of the whole model loads into the stage, strictly
        pipe.get_stage_module(s).load_state_dict({k: full[k] for k in keys}, strict=True)
    assert "tok_embeddings.weight" in pipe.get_stage_module(0).state_dict()
    assert "output.weight" in pipe.get_stage_module(1).state_dict()


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2)
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def test_nested_split_points_and_end():
    model, x = Nested(), torch.randn(5, 4)
    pipe = pipeline(model, (x,), split_spec={"blocks.0.2": BEGIN, "blocks.1.1": END})
    assert pipe.num_stages == 3
    assert pipe.module_names_per_stage == [
        ["inp", "blocks.0.0", "blocks.0.1"],
        ["blocks.0.2", "blocks.1.0", "blocks.1.1"],
        ["blocks.1.2", "out"],
    ]
    _same(_chain(pipe, x), model(x))
    # the residual input of block 0 is made in stage 0 and read in stage 1: stage 0 sends it
    assert isinstance(pipe.get_stage_module(0)(x), tuple)


class ManyInOut(nn.Module):
    """Two tensor inputs, a keyword mask, a skip across two cuts, a tuple out of a child,
    a child called twice in one stage, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(3, 6)
        self.fork = Fork()
        self.mid = nn.Linear(6, 6)
        self.last = nn.Linear(6, 2)

    def forward(self, x, y, mask=None, scale: float = 2.0):
        skip = self.a(x)
        h = skip * self.b(y)
        if mask is not None:
            h = h * mask
        u, v = self.fork(h)
        h = self.mid(self.mid(u) + v)  # mid twice, both in one stage
        return self.last(h + skip) * scale, h.sum(-1)


class Fork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p, self.q = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, h):
        return self.p(h), torch.tanh(self.q(h))


def test_several_inputs_outputs_kwargs_skips_and_tuples():
    torch.manual_seed(0)
    model = ManyInOut()
    x, y, mask = torch.randn(5, 4), torch.randn(5, 3), torch.rand(5, 6)
    spec = {"fork": BEGIN, "mid": BEGIN, "last": BEGIN}
    pipe = pipeline(model, (x, y), {"mask": mask}, split_spec=spec)
    assert pipe.num_stages == 4
    want = model(x, y, mask=mask)
    got = _chain(pipe, x, y, mask=mask)
    assert isinstance(got, tuple) and len(got) == 2
    _same(got, want)
    # fork's tuple is unpacked in its own stage; only tensors go on: u, v and the skip
    assert len(pipe.get_stage_module(1)(*pipe.get_stage_module(0)(x, y, mask=mask))) == 3
    # without the mask, it is traced away (specialised, as torch.export does)
    _same(_chain(pipeline(model, (x, y), split_spec=spec), x, y), model(x, y))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)

    def forward(self, tokens):
        return F.linear(self.body(self.emb(tokens)), self.emb.weight)  # output tied to input


def test_tied_weights_across_a_split_are_refused_by_name():
    tokens = torch.randint(0, 10, (2, 5))
    for point in (BEGIN, END):  # the head reads emb.weight directly in the last stage
        with pytest.raises(
            ValueError, match=r"'emb.weight' \(stage 0\) and 'emb.weight' \(stage 1\)"
        ):
            pipeline(Tied(), (tokens,), split_spec={"body": point})
    pipe = pipeline(Tied(), (tokens,), split_spec={})  # one stage holds both uses
    assert pipe.num_stages == 1


class SharedBuffer(nn.Module):
    """A table every layer reads, as a Llama's RoPE frequencies: no grad, so it is shared."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, 4))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * self.table
        return x


def test_a_buffer_read_by_every_stage_is_shared():
    model, x = SharedBuffer(), torch.randn(3, 4)
    pipe = pipeline(model, (x,), split_spec={"layers.1": BEGIN})
    _same(_chain(pipe, x), model(x))
    for s in range(2):
        assert pipe.get_stage_module(s).get_buffer("table") is model.table
        assert "table" in pipe.get_stage_module(s).state_dict()


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared, self.mid = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.shared(self.mid(self.shared(x)))


def test_module_called_on_both_sides_of_a_split_is_refused():
    with pytest.raises(ValueError, match="'shared.weight' \\(stage 0\\).*called in two stages"):
        pipeline(CalledTwice(), (torch.randn(2, 4),), split_spec={"mid": BEGIN})


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow in the traced forward
            h = -h
        return self.b(h)


class SizeAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0)
        return self.b(self.a(x)) / n


def test_untraceable_constructs_name_the_line_and_the_manual_split():
    x = torch.randn(2, 4)
    where = r"cannot trace Branchy.forward at .*test_pipeline_trace.py:\d+ .*if h.sum\(\) > 0"
    with pytest.raises(ValueError, match=where + ".*split_model"):
        pipeline(Branchy(), (x,), split_spec={"b": BEGIN})
    with pytest.raises(ValueError, match=r"size.* has type int, made in stage 0 and read in stage 1"):
        pipeline(SizeAcross(), (x,), split_spec={"b": BEGIN})
    with pytest.raises(ValueError, match="split point 'b' is never called"):
        pipeline(_Unused(), (x,), split_spec={"b": BEGIN})


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x)


# --- the tutorial, on 2 ranks: traced split and manual split train alike --------------------


def _tutorial_losses(traced: bool) -> list[torch.Tensor]:
    rank = comm.get_rank(comm.world_group())
    torch.manual_seed(0)
    model = Transformer()
    x = torch.randint(0, 100, (8, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 100, (8, 8), generator=torch.Generator().manual_seed(2))
    if traced:
        pipe = pipeline(module=model, mb_args=(x[:2],), split_spec={"layers.4": BEGIN})
        stage = pipe.build_stage(rank, torch.device("cpu"), comm.world_group())
    else:  # the tutorial's manual split: delete what the other stage owns
        if rank == 0:
            for i in range(4, 8):
                del model.layers[str(i)]
            model.norm, model.output = None, None
        else:
            model.tok_embeddings = None
            for i in range(4):
                del model.layers[str(i)]
        stage = PipelineStage(model, rank, 2, torch.device("cpu"))

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))

    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    losses: list[torch.Tensor] = []
    for step in range(3):
        torch.manual_seed(10 + step)  # the same dropout masks in both runs
        opt.zero_grad()
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
        opt.step()
    return losses


@distributed([2])
def test_tutorial_traced_split_trains_like_the_manual_split():
    traced, manual = _tutorial_losses(True), _tutorial_losses(False)
    if comm.get_rank(comm.world_group()) == 1:
        assert len(traced) == 12
        _same(torch.stack(traced), torch.stack(manual))
