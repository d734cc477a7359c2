"""Loading into a model built on the meta device, as torch does, side by side with torch in
the same test: set_model_state_dict / set_state_dict with full_state_dict,
broadcast_from_rank0, cpu_offload and strict; model.load_state_dict(sharded, assign=True).

For each case both libraries run the same calls on the same 2-rank model (fully_shard per
Linear, then the root): the outcome (the keys returned, or the exception's type) is torch's
except the two cases in DIFFERENT, and the loaded parameters, gathered, equal the source
state dict bitwise (a load copies or assigns, it computes nothing). set_state_dict is
set_model_state_dict then set_optimizer_state_dict: tests/examples' FSDP2 resume covers it.
"""

import pytest
import torch
from torch import nn

from plait.testing import distributed
from tests.fsdp.common import world


def _api(lib: str):
    if lib == "torch":
        from torch.distributed.checkpoint import state_dict as sd
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor
    else:
        from plait.checkpoint import state_dict as sd
        from plait.fsdp import fully_shard
        from plait.tensor import distribute_tensor
    return sd, fully_shard, distribute_tensor


def _meta_model(fully_shard) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def _source() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).state_dict()


def _outcome(fn):
    try:
        result = fn()
    except Exception as e:  # the type is the outcome compared
        return type(e)
    if result is None:
        return None
    return sorted(result.missing_keys), sorted(result.unexpected_keys)


def _case(lib: str, case: str, rank: int):
    sd, fully_shard, distribute_tensor = _api(lib)
    model = _meta_model(fully_shard)
    full = _source()
    if case == "missing":
        del full["2.bias"]
    if case == "unexpected":
        full["extra.weight"] = torch.ones(2)
    if case == "lenient":
        del full["2.bias"]
    strict = case != "lenient"
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=case == "offload",
                                  strict=strict)
    given = full if rank == 0 else {}
    if case == "assign":
        meta = model.state_dict()
        sharded = {k: nn.Parameter(distribute_tensor(v, meta[k].device_mesh, meta[k].placements))
                   for k, v in full.items()}
        outcome = _outcome(lambda: model.load_state_dict(sharded, assign=True))
    else:
        outcome = _outcome(lambda: sd.set_model_state_dict(model, given, options=options))
    loaded = {k: v.full_tensor() for k, v in model.state_dict().items() if not v.is_meta}
    return outcome, loaded


# where plait answers otherwise, on purpose: (torch's outcome, plait's)
DIFFERENT = {
    # broadcast_from_rank0: rank 0's dict may hold other pipeline stages' keys, so plait's
    # strict check counts only missing keys (torch raises on rank 0 alone, after loading)
    "unexpected": ((RuntimeError, ([], [])), ([], [])),
    # strict=False: torch returns no missing key (and leaves 2.bias on meta); plait names it
    # (the "missing" case, strict: both raise a RuntimeError; torch has loaded the other keys
    # by then, plait none)
    "lenient": (([], []), (["2.bias"], [])),
}


@distributed([2])
@pytest.mark.parametrize("case", ["full", "offload", "missing", "unexpected", "lenient", "assign"])
def test_loading_into_a_meta_model_ends_as_torchs(case):
    _, rank, _ = world()
    theirs, their_params = _case("torch", case, rank)
    ours, our_params = _case("plait", case, rank)
    full = _source()  # torch's broadcast_from_rank0 replaces the given dict's values
    if case in DIFFERENT:
        torch_says, plait_says = DIFFERENT[case]
        if case == "unexpected":
            torch_says = torch_says[0] if rank == 0 else torch_says[1]
        assert (theirs, ours) == (torch_says, plait_says), (case, theirs, ours)
    elif isinstance(theirs, type):  # plait's StateDictKeyError is a RuntimeError, as torch's
        assert isinstance(ours, type) and issubclass(ours, theirs), (case, ours, theirs)
    else:
        assert ours == theirs, (case, ours, theirs)
    if case == "missing":  # plait checks the keys before it loads any: nothing leaves meta
        assert not our_params and sorted(their_params) == ["0.bias", "0.weight", "2.weight"]
        return
    assert our_params.keys() == their_params.keys(), (sorted(our_params), sorted(their_params))
    for fqn, value in our_params.items():
        assert torch.equal(value, their_params[fqn]) and torch.equal(value, full[fqn]), fqn
