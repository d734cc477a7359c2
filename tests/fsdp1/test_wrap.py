"""plait.fsdp.wrap's policies select the modules torch's do (pure logic, no processes):
for each policy, the modules plait's traversal wraps equal those torch's _recursive_wrap /
_Policy._run_policy wraps on an identical model."""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import wrap as torch_wrap

from plait.fsdp import wrap as plait_wrap
from plait.models.llama import CONFIGS, Transformer, TransformerBlock
from tests.fsdp.common import MLP, Block


def _torch_targets(model: nn.Module, policy) -> list[str]:
    """Names of the modules torch would wrap (a marker wrapper records them)."""
    names = {id(m): n for n, m in model.named_modules()}
    chosen = []

    def marker(module, **kwargs):
        chosen.append(names[id(module)])
        return module

    if isinstance(policy, torch_wrap._Policy) and not callable(policy):
        return sorted(names[id(m)] for m in policy._run_policy(model, set(), {}) if m is not model)
    torch_wrap._recursive_wrap(model, policy, marker, ignored_modules=set(), ignored_params=set(),
                               only_wrap_children=True)
    return sorted(chosen)


def _ours(model: nn.Module, policy) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return sorted(names[id(m)] for m, _ in plait_wrap.wrap_targets(model, policy))


def _models():
    torch.manual_seed(0)
    return {"mlp": MLP(), "llama": Transformer(CONFIGS["tiny"])}


CASES = {
    "transformer": lambda lib: functools.partial(lib.transformer_auto_wrap_policy,
                                                 transformer_layer_cls={Block, TransformerBlock}),
    "size_150": lambda lib: functools.partial(lib.size_based_auto_wrap_policy, min_num_params=150),
    "size_5000": lambda lib: functools.partial(lib.size_based_auto_wrap_policy, min_num_params=5000),
    "lambda": lambda lib: functools.partial(lib.lambda_auto_wrap_policy,
                                            lambda_fn=lambda m: isinstance(m, (nn.Linear, nn.Embedding))),
    "always": lambda lib: lib.always_wrap_policy,
    "module": lambda lib: lib.ModuleWrapPolicy({Block, TransformerBlock, nn.RMSNorm}),
    "custom": lambda lib: lib.CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features > 12),
}


@pytest.mark.parametrize("model_name", ["mlp", "llama"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_selects_what_torch_selects(case, model_name):
    model = _models()[model_name]
    ours = _ours(model, CASES[case](plait_wrap))
    assert ours == _torch_targets(model, CASES[case](torch_wrap))
    if case in ("transformer", "module"):
        assert ours  # the policies do select something here


def test_children_before_parents_and_custom_kwargs():
    model = _models()["mlp"]
    targets = plait_wrap.wrap_targets(model, plait_wrap.CustomPolicy(
        lambda m: {"sharding_strategy": "x"} if isinstance(m, Block) else isinstance(m, nn.Linear)),
        root_kwargs={"a": 1})
    order = [m for m, _ in targets]
    for m, kwargs in targets:
        assert kwargs == ({"a": 1, "sharding_strategy": "x"} if isinstance(m, Block) else {"a": 1})
        for child in m.modules():
            if child is not m and child in order:
                assert order.index(child) < order.index(m)
    with pytest.raises(ValueError, match="must return False/True or a dict"):
        plait_wrap.wrap_targets(model, plait_wrap.CustomPolicy(lambda m: 3))


def test_enable_wrap():
    calls = []
    with plait_wrap.enable_wrap(wrapper_cls=lambda m, **kw: calls.append(kw) or m, x=1):
        plait_wrap.wrap(nn.Linear(2, 2), y=2)
    assert calls == [{"x": 1, "y": 2}]
    lin = nn.Linear(2, 2)
    assert plait_wrap.wrap(lin) is lin  # outside a context: unchanged
