"""Save in one layout, resume in another, through plait.checkpoint.save/load and the state dict API.

Source layout X trains 2 steps, saves {"model", "optim"} (get_state_dict, flattened optimizer
state: pipeline stages hold different param groups, so each value must be per-FQN), then takes
a 3rd step: the uninterrupted run. Target layout Y (built from another seed) loads into its own
get_state_dict template, set_state_dict's it, and must hold X's state after step 2 bitwise
(parameters, buffers, exp_avg/exp_avg_sq, step counts, hyperparameters); its 3rd step then
equals X's within rtol 1e-4 / atol 1e-6 (the two layouts reduce gradients in different orders,
~1e-7 relative; Adam's sqrt(v) can amplify that on tiny-v elements; see test_state_dict.py).
Pairs: every layout once as source and once as target, world sizes 1 to 4, up and down.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map_only

import plait.checkpoint as dcp
from plait.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from plait.testing import run_distributed
from tests.checkpoint._layouts import build, full_state, lay_out, make_opt, step
from tests.checkpoint.test_state_dict import TOL

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

PAIRS = [  # (source, its world, target, its world)
    ("single", 1, "fsdp", 3), ("fsdp", 3, "pp", 2), ("pp", 2, "tp", 3), ("tp", 3, "fsdp_tp", 4),
    ("fsdp_tp", 4, "fsdp", 3), ("fsdp_tp", 4, "single", 1),  # norms TP leaves whole: one copy per tp rank, written once
    ("ddp", 2, "hsdp", 4), ("hsdp", 4, "ddp", 2), ("fsdp", 4, "fsdp", 2),
    ("replicate", 3, "tp", 2), ("tp", 2, "replicate", 2), ("fsdp", 2, "ac", 2), ("ac", 1, "compile", 1),
    ("compile", 1, "fsdp1", 3), ("fsdp1", 2, "tp", 2),
]


def _merged(states):
    """The full state of the whole model: pp stages each hold part of it."""
    msd, osd = {}, {"state": {}, "param_groups": []}
    for m, o in states:
        msd.update(m)
        osd["state"].update(o["state"])
        osd["param_groups"] += o["param_groups"]
    return msd, osd


def save_source(path: str, layout: str):
    model = lay_out(build(0), layout)
    opt = make_opt(model)
    for i in range(2):
        step(model, opt, layout, i)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = tree_map_only(torch.Tensor, torch.clone, full_state(model, opt))  # not the live params
    step(model, opt, layout, 2)
    return saved, full_state(model, opt)


def resume_target(path: str, layout: str, saved, after) -> bool:
    model = lay_out(build(9), layout)
    opt = make_opt(model)
    msd, osd = get_state_dict(model, opt, options=FLAT)  # the template: this layout's own pieces
    state = {"model": msd, "optim": osd}
    # a pp stage holds part of the model: the checkpoint's other keys are not its own
    planner = dcp.DefaultLoadPlanner(allow_partial_load=layout == "pp")
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    _assert_subset(full_state(model, opt), saved, exact=True)
    step(model, opt, layout, 2)
    _assert_subset(full_state(model, opt), after, exact=False)
    return True


def _assert_subset(got, ref, *, exact: bool) -> None:
    """`got` (this rank's model: all of it, or a pp stage's part) equals `ref` where it has keys."""
    check = (lambda a, b, k: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)) if exact else \
        (lambda a, b, k: torch.testing.assert_close(a, b, **TOL, msg=k))
    (msd, osd), (rsd, rosd) = got, ref
    assert msd and set(msd) <= set(rsd), (sorted(msd), sorted(rsd))
    for k, v in msd.items():
        check(v, rsd[k], k)
    assert set(osd["state"]) == {k for k in rosd["state"] if k in msd}
    for fqn, s in osd["state"].items():
        assert torch.equal(s["step"], rosd["state"][fqn]["step"]), fqn
        for key in ("exp_avg", "exp_avg_sq"):
            check(s[key], rosd["state"][fqn][key], f"{fqn}.{key}")
    ref_group = {k: v for k, v in rosd["param_groups"][0].items() if k != "params"}
    assert all({k: v for k, v in g.items() if k != "params"} == ref_group for g in osd["param_groups"])


def _run(fn, n, *args):
    return [fn(*args)] if n == 1 else run_distributed(fn, *args, world_size=n)


@pytest.mark.parametrize("source,n_source,target,n_target", PAIRS, ids=str)
def test_resume_in_another_layout(tmp_path, source, n_source, target, n_target):
    path = str(tmp_path / "ckpt")
    results = _run(save_source, n_source, path, source)
    saved = _merged([r[0] for r in results]) if source == "pp" else results[0][0]
    after = _merged([r[1] for r in results]) if source == "pp" else results[0][1]
    assert all(_run(resume_target, n_target, path, target, saved, after))
