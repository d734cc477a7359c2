"""Start-up, groups and meshes, buffers, state dicts, and the errors a user can make.

Comparisons here are exact (broadcasts copy bits) except the sub-group parity, which has
test_parity's tolerances for test_parity's reasons.
"""

import functools

import pytest
import torch
from torch import nn

from plait import comm
from plait.ddp import DistributedDataParallel, replicate, replicate_state
from plait.device_mesh import init_device_mesh
from plait.testing import assert_synced, distributed
from tests.ddp.common import PER_RANK, ConvBN, assert_params_close, batch, build, loss_fn, world


@distributed([2, 3])
def test_parameter_shapes_differ_across_ranks():
    g, rank, n = world()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5 if rank == 1 else 4))
    with pytest.raises(ValueError, match=r"1\.weight has shape \(4, 4\) \(torch\.float32\) on rank 0 but "
                                         r"shape \(5, 4\) \(torch\.float32\) on rank 1"):
        DistributedDataParallel(model)
    extra = nn.Sequential(*[nn.Linear(2, 2) for _ in range(2 + (rank == n - 1))])
    with pytest.raises(ValueError, match=rf"has no such tensor on rank 0 but shape \(2, 2\) \(torch\.float32\) "
                                         rf"on rank {n - 1} \(4 tensors on rank 0, 6 on rank {n - 1}\)"):
        DistributedDataParallel(extra)


@distributed([2])
def test_state_dict_keys_and_buffers():
    g, rank, n = world()
    ddp = DistributedDataParallel(ConvBN())
    assert all(k.startswith("module.") for k in ddp.state_dict())
    model = ConvBN()
    keys = list(model.state_dict())
    replicated = replicate(model)
    assert list(replicated.state_dict()) == keys and type(replicated).__name__ == "ReplicateConvBN"
    assert isinstance(replicated, ConvBN)
    with pytest.raises(RuntimeError, match="already replicated"):
        replicate(model)
    # broadcast_buffers=False: running stats stay each rank's own
    local = DistributedDataParallel(ConvBN(), broadcast_buffers=False)
    local(torch.randn(PER_RANK, 2, 5, 5) + rank)
    with pytest.raises(AssertionError, match="differs"):
        assert_synced(local.module.bn.running_mean, g)
    # broadcast_buffers=True: rank 0's stats are everyone's before each forward
    with torch.no_grad():
        ddp.module.bn.running_mean.fill_(float(rank))
    assert ddp.will_sync_module_buffers()
    ddp.eval()
    with torch.no_grad():
        ddp(torch.randn(PER_RANK, 2, 5, 5))
    assert_synced(ddp.module.bn.running_mean, g)
    assert not ddp.will_sync_module_buffers()  # a forward without grad did not sync


@distributed([2])
def test_buffers_broadcast_each_forward_follow_reassignment():
    """Every training forward broadcasts the buffers found then (pytorch#63916): a buffer the
    module replaced, and one it added, are rank 0's after the next forward, as in torch."""
    g, rank, n = world()
    ddp = DistributedDataParallel(ConvBN())
    bn = ddp.module.bn
    for step in range(3):
        with torch.no_grad():  # float stats (one flat broadcast) and the int64 count (in place)
            bn.running_mean.fill_(float(rank + step))
            bn.num_batches_tracked.fill_(10 * rank)
        if step == 1:
            bn.running_var = torch.full((4,), float(rank + 5))  # reassigned: a new tensor
        if step == 2:
            bn.register_buffer("extra", torch.full((2, 3), float(rank), dtype=torch.float64))
        same = torch.randn(PER_RANK, 2, 5, 5, generator=torch.Generator().manual_seed(step))
        ddp(same).sum().backward()  # the same update on every rank: equal after only if equal before
        for buffer in ddp.module.buffers():
            assert_synced(buffer, g)
        assert bn.num_batches_tracked.item() == 1, "rank 0's count, then its forward's increment"
    assert bn.extra.eq(0.0).all() and bn.extra.dtype == torch.float64


def test_buffers_of_is_named_buffers_without_names():
    from plait.ddp.replica import buffers_of, named_buffers

    shared = nn.BatchNorm1d(3)
    model = nn.Sequential(shared, nn.Sequential(shared, nn.Linear(3, 3)), nn.BatchNorm1d(2))
    model[1].register_buffer("none", None)
    model[2].register_buffer("alias", model[2].running_mean)  # one tensor under two names
    model.add_module("gone", None)
    expected = [b for _, b in named_buffers(model)]
    assert [id(b) for b in buffers_of(model)] == [id(b) for b in expected]
    assert [id(b) for b in expected] == [id(b) for b in model.buffers()]


@distributed([2, 4])
def test_device_mesh_and_groups():
    g, rank, n = world()
    mesh = init_device_mesh("cpu", (n,))
    ddp = DistributedDataParallel(build("mlp", seed=rank), device_mesh=mesh)
    assert ddp.process_group is mesh.get_group()
    with pytest.raises(ValueError, match="not both"):
        DistributedDataParallel(build("mlp", seed=0), process_group=g, device_mesh=mesh)
    if n == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match=r"1-D device mesh, got 2-D"):
            DistributedDataParallel(build("mlp", seed=0), device_mesh=mesh2)
        dp = replicate(build("mlp", seed=rank), device_mesh=mesh2["dp"])  # ranks {0, 2} and {1, 3}
        assert comm.get_world_size(replicate_state(dp).group) == 2


@distributed([3])
def test_subgroup_averages_over_its_own_ranks():
    """DDP on ranks {0, 2} of 3: gradients are averaged over 2 ranks; rank 1 is not in it."""
    g, rank, n = world()
    if rank == 1:
        return
    sub = comm.new_group([0, 2])
    me = comm.get_rank(sub)
    model, ref = build("mlp", seed=rank), build("mlp", seed=0)
    ddp = DistributedDataParallel(model, process_group=sub, bucket_cap_mb=0.0005)
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch("mlp", step, 2 * PER_RANK)
        loss_fn("mlp", ddp(x[me * PER_RANK:(me + 1) * PER_RANK]), y[me * PER_RANK:(me + 1) * PER_RANK]).backward()
        loss_fn("mlp", ref(x), y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_close(model, ref, atol=2e-5, rtol=1e-4, what="sub-group")


@distributed([2])
def test_ignored_parameters_are_neither_synced_nor_reduced():
    g, rank, n = world()
    model = build("mlp", seed=rank)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["fc3.weight", "fc3.bias"])
    ddp = DistributedDataParallel(model)
    assert_synced(model.fc1.weight, g)
    with pytest.raises(AssertionError, match="differs"):
        assert_synced(model.fc3.weight, g)
    ddp(torch.randn(PER_RANK, 6) + rank).sum().backward()
    assert_synced(model.fc1.weight.grad, g)
    with pytest.raises(AssertionError, match="differs"):
        assert_synced(model.fc3.weight.grad, g)
    assert all("fc3" not in name for b in ddp.reducer.buckets for name in b.fqns)


class Marked(torch.Tensor):
    """A tensor subclass standing in for a DTensor parameter."""


@distributed([1])
def test_user_errors():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter that requires a gradient"):
        DistributedDataParallel(frozen)
    with pytest.raises(ValueError, match="sparse=True"):
        DistributedDataParallel(nn.Embedding(4, 2, sparse=True))
    with pytest.raises(ValueError, match="device_ids"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
    subclassed = nn.Linear(2, 2)
    subclassed.weight = nn.Parameter(subclassed.weight.detach().as_subclass(Marked))
    with pytest.raises(TypeError, match="parameter weight is a Marked; .* plain tensor parameters"):
        DistributedDataParallel(subclassed)
    ddp = DistributedDataParallel(nn.Linear(2, 2))
    ddp.register_comm_hook(None, lambda state, bucket: 3)
    with pytest.raises(RuntimeError, match="already registered"):
        ddp.register_comm_hook(None, lambda state, bucket: 3)
    with pytest.raises(TypeError, match="must return a torch.futures.Future"):
        ddp(torch.randn(1, 2)).sum().backward()
    with pytest.raises(TypeError, match="callable"):
        DistributedDataParallel(nn.Linear(2, 2)).register_comm_hook(None, 3)


@distributed([2])
def test_replicate_hooks_sit_among_a_module_s_own_as_torch_s_do_and_train_the_same():
    """replicate registers pre_forward and post_forward as the module's hooks when it is
    called, as torch's replicate does: a user's hooks registered before run before them, those
    registered after run after (the hook lists are compared with torch's replicate's on the
    same model). Hooks that change the input and the output, and a module whose instance
    carries its own forward, train to the average over ranks of the same loss (parity,
    test_parity's tolerances)."""
    from torch.distributed._composable.replicate import replicate as torch_replicate

    g, rank, n = world()

    def kinds(m):
        mine = {id(h) for h in (pre_before, pre_after, post_before, post_after)}
        return ([("user" if id(h) in mine else "replicate") for h in m._forward_pre_hooks.values()],
                [("user" if id(h) in mine else "replicate") for h in m._forward_hooks.values()])

    def pre_before(_m, args):
        return (args[0] * 2,)

    def pre_after(_m, args):
        return (args[0] - 1,)

    def post_before(_m, _args, out):
        return out + 1

    def post_after(_m, _args, out):
        return out * 0.5

    orders = []
    for apply in (replicate, torch_replicate):
        m = build("mlp", seed=0)
        m.register_forward_pre_hook(pre_before), m.register_forward_hook(post_before)
        apply(m)
        m.register_forward_pre_hook(pre_after), m.register_forward_hook(post_after)
        orders.append(kinds(m))
    assert orders[0] == orders[1] == (["user", "replicate", "user"], ["user", "replicate", "user"]), orders
    for variant in ("hooks", "instance forward"):
        model, ref = build("mlp", seed=rank), build("mlp", seed=0)
        if variant == "hooks":
            for m in (model, ref):
                m.register_forward_pre_hook(pre_before), m.register_forward_hook(post_before)
            replicate(model)
            for m in (model, ref):
                m.register_forward_pre_hook(pre_after), m.register_forward_hook(post_after)
        else:
            for m in (model, ref):  # the class's forward, captured before replicate changes the class
                m.forward = functools.partial(_tripled, type(m).forward, m)
            replicate(model)
            assert replicate_state(model).forward is not None
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            x, y = batch("mlp", step, n * PER_RANK)
            loss_fn("mlp", model(x[rank * PER_RANK:(rank + 1) * PER_RANK]), y[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
            loss_fn("mlp", ref(x), y).backward()
            assert_synced(model.fc1.weight.grad, g)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        assert_params_close(model, ref, atol=2e-5, rtol=1e-4, what=variant)


def _tripled(forward, module, x):
    return forward(module, x) * 3
