"""torch.compile of a parallelized transformer block (TP, and TP+SP) gives the eager
result, forward and backward, with no graph break: the styles' boundary conversions are
functions allowed in the graph (layouts.boundary), so Dynamo records each as one node
and AOTAutograd traces the collectives inside them.

Graph breaks are counted with torch._dynamo.utils.counters["graph_break"] (expected: 0)
and by compiling with fullgraph=True (a break raises); one frame is compiled for the
block. Backend "aot_eager": it runs the traced graph without code generation (what plait
owns is the tracing). Tolerance 1e-5 (float32): the same ops, traced.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from plait.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from plait.testing import distributed

from ._block import make_block, parallel_block

TOL = dict(atol=1e-5, rtol=1e-5)


def _grads(block):
    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in block.parameters()]


@distributed([2], timeout=300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_compiled_block_matches_eager_without_graph_breaks(world_size, sp):
    mesh = init_device_mesh("cpu", (world_size,))
    heads = 6 if world_size == 3 else 4
    eager_block = parallel_block(make_block(12, heads, 24), mesh, sp)
    block = parallel_block(make_block(12, heads, 24), mesh, sp)
    x = torch.randn(2, 12, 12, generator=torch.Generator().manual_seed(1))
    inp = distribute_tensor(x, mesh, [Shard(1)]).to_local() if sp else x

    want = eager_block(inp)
    want.pow(2).sum().backward()

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(block, backend=counter, fullgraph=True)(inp)
    got.pow(2).sum().backward()
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counter.frame_count == 1, "one graph for the whole block"
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(_grads(block), _grads(eager_block)):
        torch.testing.assert_close(g, w, **TOL)


@distributed([2], timeout=300)
def test_compiled_loss_parallel_matches_eager_without_graph_breaks():
    """A vocab-parallel head and loss_parallel inside the compiled function."""
    import torch.nn.functional as F

    from plait.tensor import Replicate
    from plait.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    from .test_loss import TinyLM

    mesh = init_device_mesh("cpu", (2,))
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(), "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)}
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(parallelize_module(TinyLM(), mesh, plan))
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 11, (2, 6), generator=g), torch.randint(0, 11, (2, 6), generator=g)

    def step(model, ids, labels):
        with loss_parallel():
            return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), label_smoothing=0.1)

    want = step(models[0], ids, labels)
    want.backward()
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(models[1], ids, labels)
    got.backward()
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    torch.testing.assert_close(got.full_tensor(), want.full_tensor(), **TOL)
    for g_, w in zip(_grads(models[1]), _grads(models[0])):
        torch.testing.assert_close(g_, w, **TOL)
