"""get_state_dict / set_state_dict in every layout against one process.

- full_state_dict=True from any layout equals the single-process model's state dict and its
  FQN-keyed optimizer state, after the same two AdamW steps (tied weights, uneven dims, world 3).
- set_state_dict from a single-process state (full, or broadcast from rank 0) into any layout
  gives back that state bitwise, and the next step equals the single-process step.
Tolerance after training, rtol 1e-4 / atol 1e-6 (fp32): the layouts average gradients over ranks
in another order than one process sums them (~1e-7 relative), and Adam divides by sqrt(v), which
can amplify that for elements with tiny v; a wrong slice or a missed reduction is O(1) off.
"""

from __future__ import annotations

import pytest
import torch

from plait.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from plait.tensor import DTensor
from plait.testing import run_distributed
from tests.checkpoint._layouts import build, full_state, lay_out, make_opt, step, world

TOL = dict(rtol=1e-4, atol=1e-6)
CASES = [("single", 1), ("ddp", 2), ("replicate", 3), ("fsdp", 2), ("fsdp", 3), ("hsdp", 4), ("tp", 2),
         ("tp", 3), ("fsdp_tp", 4), ("pp", 2), ("compile", 1), ("ac", 2),
         ("fsdp1", 2), ("fsdp1", 3)]
TIED = [("single", 1), ("ddp", 2), ("fsdp", 3)]


def _stage_keys(layout: str, keys) -> list[str]:
    """The reference keys this rank's model holds (a pp stage holds its units' only)."""
    if layout != "pp":
        return list(keys)
    units = ("inp.", "mid.") if world()[0] == 0 else ("out.",)
    return [k for k in keys if k.startswith(units)]


def assert_states(msd, osd, rsd, rosd, layout, *, exact: bool) -> None:
    check = (lambda a, b, k: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)) if exact else \
        (lambda a, b, k: torch.testing.assert_close(a, b, **TOL, msg=k))
    assert list(msd) == _stage_keys(layout, rsd), (list(msd), list(rsd))
    for k, v in msd.items():
        assert type(v) is torch.Tensor, (k, type(v))  # full: plain tensors, no DTensor
        check(v, rsd[k], k)
    assert list(osd["state"]) == _stage_keys(layout, rosd["state"])
    for fqn, state in osd["state"].items():
        assert state.keys() == rosd["state"][fqn].keys()
        assert torch.equal(state["step"], rosd["state"][fqn]["step"]), fqn  # step counts exact
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(state[key]) is torch.Tensor
            check(state[key], rosd["state"][fqn][key], f"{fqn}.{key}")
    ref_groups = [{**g, "params": _stage_keys(layout, g["params"])} for g in rosd["param_groups"]]
    assert osd["param_groups"] == ref_groups


def full_equals_reference(layout: str, tied: bool) -> bool:
    ref, model = build(0, tied=tied), lay_out(build(0, tied=tied), layout)
    ref_opt, opt = make_opt(ref), make_opt(model)
    for i in range(2):
        step(ref, ref_opt, "single", i)
        step(model, opt, layout, i)
    sharded, sharded_optim = get_state_dict(model, opt)
    if layout in ("fsdp", "tp", "fsdp_tp", "hsdp", "fsdp1"):  # the default (not full) state keeps DTensors
        assert any(isinstance(v, DTensor) for v in sharded.values())
        assert any(isinstance(s["exp_avg"], DTensor) for s in sharded_optim["state"].values())
    assert_states(*full_state(model, opt), *get_state_dict(ref, ref_opt), layout, exact=False)
    return True


def set_from_reference(layout: str, tied: bool, broadcast: bool) -> bool:
    ref = build(0, tied=tied)
    ref_opt = make_opt(ref)
    step(ref, ref_opt, "single", 0)
    rsd, rosd = get_state_dict(ref, ref_opt)
    model = lay_out(build(7, tied=tied), layout)  # another seed: every value must come from rsd
    opt = make_opt(model)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=layout != "pp")
    given = ({}, {}) if broadcast and world()[0] != 0 else (rsd, rosd)
    keys = set_state_dict(model, opt, model_state_dict=given[0], optim_state_dict=given[1], options=options)
    assert keys.missing_keys == [] and (layout == "pp" or keys.unexpected_keys == [])
    assert_states(*full_state(model, opt), rsd, rosd, layout, exact=True)
    step(ref, ref_opt, "single", 1)
    step(model, opt, layout, 1)
    assert_states(*full_state(model, opt), *get_state_dict(ref, ref_opt), layout, exact=False)
    return True


def _run(fn, n, *args):
    return [fn(*args)] if n == 1 else run_distributed(fn, *args, world_size=n)


@pytest.mark.parametrize("layout,n,tied", [(c, n, False) for c, n in CASES] + [(c, n, True) for c, n in TIED],
                         ids=str)
def test_full_state_dict_equals_one_process(layout, n, tied):
    assert all(_run(full_equals_reference, n, layout, tied))


@pytest.mark.parametrize("layout,n,tied", [(c, n, False) for c, n in CASES] + [(c, n, True) for c, n in TIED],
                         ids=str)
def test_set_from_one_process_then_step(layout, n, tied):
    assert all(_run(set_from_reference, n, layout, tied, False))


@pytest.mark.parametrize("layout,n", [("ddp", 2), ("fsdp", 3), ("tp", 2), ("fsdp_tp", 4), ("pp", 2), ("fsdp1", 3)],
                         ids=str)
def test_broadcast_from_rank0(layout, n):
    assert all(_run(set_from_reference, n, layout, False, True))
