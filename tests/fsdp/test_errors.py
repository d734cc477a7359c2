"""Bad input to fully_shard gets a clear error naming the module, raised before anything
is sent."""

import pytest
import torch
from torch import nn

from plait.debug import CommDebugMode
from plait.device_mesh import DeviceMesh, init_device_mesh
from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.testing import distributed
from tests.fsdp.common import build, world


@distributed([2])
def test_errors_name_the_module():
    _, rank, n = world()
    mesh = init_device_mesh("cpu", (n,))
    with CommDebugMode() as mode:
        model = build("mlp")
        fully_shard(model.blocks[0], mesh=mesh)
        with pytest.raises(ValueError, match="already applied to Block"):
            fully_shard(model.blocks[0], mesh=mesh)

        tied = build("tied")
        fully_shard(tied.head, mesh=mesh)  # takes the tied weight into its own group
        with pytest.raises(ValueError, match=r"parameter 'weight' of Embedding is shared with group "
                                             r"fully_shard\(Linear\)"):
            fully_shard(tied, mesh=mesh)

        with pytest.raises(ValueError, match=r"fully_shard\(MLP\) got a 3-D mesh"):
            fully_shard(build("mlp"), mesh=DeviceMesh("cpu", torch.arange(n).view(n, 1, 1)))

        with pytest.raises(ValueError, match=r"fully_shard\(MLP\): the mesh is on cuda, which this process cannot use, and buffer .scale. of MLP"):
            fully_shard(build("mlp"), mesh=DeviceMesh("cuda", list(range(n))))

        with pytest.raises(ValueError, match=r"fully_shard\(MLP\): reshard_after_forward=3 must be a factor "
                                             r"of the shard axis size 2"):
            fully_shard(build("mlp"), mesh=mesh, reshard_after_forward=3)
        with pytest.raises(TypeError, match=r"fully_shard\(MLP\): reshard_after_forward must be a bool, an int"):
            fully_shard(build("mlp"), mesh=mesh, reshard_after_forward=2.0)

        mixed = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).to(torch.float64))
        with pytest.raises(ValueError, match=r"fully_shard\(Sequential\) groups parameters of dtypes"):
            fully_shard(mixed, mesh=mesh)
        fully_shard(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).to(torch.float64)), mesh=mesh,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))  # one all-gather dtype: fine

        with pytest.raises(TypeError, match="takes an nn.Module"):
            fully_shard(torch.zeros(3), mesh=mesh)

        pair = [nn.Linear(3, 3), nn.Linear(3, 3)]
        fully_shard(pair, mesh=mesh)
        with pytest.raises(RuntimeError, match="root of fully_shard must be one module"):
            pair[0](torch.zeros(2, 3))
    assert mode.get_total_counts() == 0, mode.get_comm_counts()


@distributed([2])
def test_ignored_params_stay_plain_and_unreduced():
    _, rank, n = world()
    model = build("mlp")
    fully_shard(model, ignored_params={model.head.bias})
    assert not hasattr(model.head.bias, "placements")
    assert hasattr(model.head.weight, "placements")
    model(torch.randn(2, 7)).sum().backward()
    assert model.head.bias.grad is not None and not hasattr(model.head.bias.grad, "placements")
