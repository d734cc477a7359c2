"""What the FullyShardedDataParallel tests share: the wrap policies over tests/fsdp's
models (whose parity protocol and helpers they reuse: FSDP's named_parameters gives the
original names, so tests.fsdp.common's loops compare it with the plain reference)."""

from __future__ import annotations

import functools

from torch import nn

from plait.fsdp import FullyShardedDataParallel as FSDP
from plait.fsdp.wrap import (
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from tests.fsdp.common import Block

POLICIES = {
    "transformer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    # Block(13, 11) has 154 parameters, Block(11, 13) 156, the whole MLP 484: each block wraps,
    # the blocks' ModuleList never (excluded), the root takes inp and head
    "size": functools.partial(size_based_auto_wrap_policy, min_num_params=150),
    "module": ModuleWrapPolicy({Block}),
}


def wrap(model: nn.Module, policy: str = "transformer", **kwargs) -> FSDP:
    """FSDP over a policy, with use_orig_params=True unless given: these tests read the
    per-parameter shards by name (the flat parameter of torch's default,
    use_orig_params=False, is tested against torch's in test_flat_param.py)."""
    kwargs.setdefault("use_orig_params", True)
    return FSDP(model, auto_wrap_policy=POLICIES[policy], **kwargs)


def units(model: nn.Module) -> list[str]:
    """The wrapped modules' class names, outermost first."""
    return [type(u.module).__name__ for u in FSDP.fsdp_modules(model)]
