"""torch.compile on DTensors: Dynamo traces a Linear -> GELU -> Linear block with
colwise / rowwise DTensor weights in one graph, no graph break, and the compiled block
gives the eager result, forward and backward, including when the graph itself must
communicate (a Partial output fed to a nonlinearity, an input sharded on its features:
collectives inside the graph, traced as c10d functional collectives).

Graph breaks are counted by compiling with fullgraph=True (any break raises) through a
counting backend (one frame compiled = one graph). Run on 3 ranks: the 10 hidden units
split 4, 3, 3. The counted backend is "aot_eager", which runs the traced graph without
code generation (the part plait owns is the tracing). Tolerance 1e-5 (float32): the same
ops in the same order, traced.
"""

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from plait.testing import distributed

from ._helpers import ints, mesh_for
from .test_extend import _mlp, colwise_rowwise

TOL = dict(atol=1e-5, rtol=1e-5)


def _grads(model):
    return [p.grad.full_tensor() for p in model.parameters()]


@distributed([3])
def test_compiled_tensor_parallel_block_matches_eager():
    mesh = mesh_for(3)
    model = colwise_rowwise(_mlp(), mesh)
    x = distribute_tensor(ints(2, 3, 6, seed=1) / 4, mesh, [Replicate()])

    eager = model(x)
    eager.full_tensor().pow(2).sum().backward()
    eager_grads = _grads(model)
    model.zero_grad()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)  # a graph break raises
    out = compiled(x)
    assert counter.frame_count == 1, "one graph for the whole block"
    assert isinstance(out, DTensor) and out.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), eager.full_tensor(), **TOL)
    out.full_tensor().pow(2).sum().backward()
    for got, want in zip(_grads(model), eager_grads):
        torch.testing.assert_close(got, want, **TOL)

    # collectives inside the graph: relu needs the Partial output reduced (a reduce-scatter,
    # uneven on 3 ranks), and an input sharded on its features is gathered first
    def block(x):
        return torch.relu(model(x)) * 2

    sharded = distribute_tensor(ints(2, 3, 6, seed=2) / 4, mesh, [Shard(2)])
    for inp in (x, sharded):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        got = torch.compile(block, backend=counter, fullgraph=True)(inp)
        assert counter.frame_count == 1
        torch.testing.assert_close(got.full_tensor(), block(inp).full_tensor(), **TOL)
