"""Collectives inside a torch.compile'd DTensor graph pass plait.comm's door: CommDebugMode
counts the same collectives (op by op, forward and backward) for the compiled block as
for the eager one, the flight recorder lists each of them, completed, at the user's line,
and under DETAIL every rank's fingerprints are compared before each graph collective.

The block is tensor parallel by hand (tests/tensor/test_extend.py): Linear colwise, GELU,
Linear rowwise, then relu(2x) of the Partial output, on an input sharded on its features.
Forward: an all-gather (the sharded input) and a reduce-scatter (Partial -> Shard for
relu, uneven on 3 ranks); backward the reverse moves. Compiled with fullgraph=True (a
graph break raises) through "aot_eager", which runs the traced graph as traced, plait's
bracket ops included. Values compared at 1e-5 (float32, the same ops in the same order).
"""

import json

import torch
import torch._dynamo

from plait import debug
from plait.debug import session
from plait.tensor import Shard, distribute_tensor
from plait.testing import distributed

from ._helpers import ints, mesh_for
from .test_extend import _mlp, colwise_rowwise

TOL = dict(atol=1e-5, rtol=1e-5)


def _step(fn, model, x):
    """Forward and backward of `fn(x)` with no collective outside `fn`'s graphs; returns
    (local output, local grads, CommDebugMode)."""
    model.zero_grad()
    with debug.CommDebugMode() as mode:
        out = fn(x).to_local()
        out.pow(2).sum().backward()
    return out.detach(), [p.grad.to_local().clone() for p in model.parameters()], mode


@distributed([3])
def test_compiled_dtensor_collectives_are_counted_recorded_and_checked(tmp_path):
    mesh = mesh_for(3)
    model = colwise_rowwise(_mlp(), mesh)
    x = distribute_tensor(ints(2, 3, 6, seed=2) / 4, mesh, [Shard(2)])

    def block(x):
        return torch.relu(model(x) * 2)

    want, want_grads, eager = _step(block, model, x)
    assert eager.get_total_counts() > 0 and "reduce_scatter" in eager.get_comm_counts()

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # a graph break raises
    _step(compiled, model, x)  # compiles; runs once
    recorder = session.session().recorder
    before = recorder.total
    got, got_grads, mode = _step(compiled, model, x)

    assert mode.get_comm_counts() == eager.get_comm_counts(), (mode.get_comm_counts(), eager.get_comm_counts())
    # the same ops with the same shapes; a compiled backward may order independent ones differently
    assert sorted((e.op, e.output_shapes) for e in mode.events) == sorted((e.op, e.output_shapes) for e in eager.events), (
        [(e.op, e.output_shapes) for e in mode.events], [(e.op, e.output_shapes) for e in eager.events])
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)

    entries = recorder.entries()[-(recorder.total - before):]
    assert [e.op for e in entries] == [e.op for e in mode.events]
    assert all(e.impl == "functional" and e.state == "completed" for e in entries), [e.to_dict() for e in entries]
    assert [e.seq for e in entries] == list(range(entries[0].seq, entries[0].seq + len(entries)))
    assert all(e.site and e.site[0].endswith("test_compile_door.py") for e in entries), [e.site for e in entries]

    with debug.configured(level="DETAIL", trace_dir=str(tmp_path)):  # fingerprints compared per op
        checked, _, detail = _step(compiled, model, x)
        doc = debug.dump_flight_recorder()
    torch.testing.assert_close(checked, want, **TOL)
    assert detail.get_comm_counts() == eager.get_comm_counts()


    listed = json.loads(open(doc).read())["entries"][-len(entries):]
    assert [e["op"] for e in listed] == [e.op for e in entries] and all(e["state"] == "completed" for e in listed)


@distributed([2])
def test_dtensor_gives_inductor_a_cache_key_and_picklable_metadata():
    """What AOTAutograd's cache asks of a tensor subclass (under Inductor): a stable hash,
    and flatten metadata that pickles (the mesh's process groups cannot; without both,
    every compile warned on every rank)."""
    import pickle

    mesh = mesh_for(2)
    a = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    b = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    c = distribute_tensor(torch.ones(4, 3), mesh, [Shard(1)])
    assert a._stable_hash_for_caching() == b._stable_hash_for_caching() != c._stable_hash_for_caching()
    _, meta = a.__tensor_flatten__()
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta and back.mesh.get_group(0) is mesh.get_group(0)
