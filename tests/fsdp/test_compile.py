"""torch.compile per block before fully_shard (torch's recommended order) trains like
eager, and the blocks' forwards compile without graph breaks: fully_shard's hooks run
outside the graph (dynamo-disabled): no graph breaks at all, one graph per block, and no
recompilation over the steps although the unsharded parameters' storage is freed and
refilled every step. Backend aot_eager (AOTAutograd's
forward/backward split without inductor's code generation, to keep the test fast);
tolerances as in test_parity.py, since aot_eager runs the same aten ops."""


from plait.testing import distributed
from tests.fsdp.common import assert_full_params_close, build, shard, train_parity, world


@distributed([2])
def test_compiled_blocks_train_like_eager():
    import torch._dynamo

    _, rank, n = world()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, ref = build("mlp"), build("mlp")
    for block in model.blocks:
        block.compile(backend="aot_eager")
    shard(model)
    train_parity("mlp", model, ref, steps=10)
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="compiled blocks after 10 steps")
    counters = torch._dynamo.utils.counters
    breaks = dict(counters["graph_break"])
    frames = counters["stats"]["unique_graphs"]
    print(f"graph breaks {breaks}, unique graphs {frames}")
    assert breaks == {}, breaks  # none anywhere: the hooks run outside the graph
    assert frames == len(model.blocks), frames  # one graph per block, none recompiled over 10 steps
