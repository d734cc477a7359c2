"""torch.compile over FullyShardedDataParallel: `torch.compile(FSDP(mlp, auto_wrap_policy=
transformer policy))`, FULL_SHARD and SHARD_GRAD_OP, trains like the same wrapper in eager,
breaks no graph inside the user's blocks, does not recompile over the steps, and emits no
warning of plait's making.

What is measured, on 2 ranks, the MLP of tests/fsdp/common.py (two Block units and the root):

- graph breaks (torch._dynamo.utils.counters["graph_break"]): exactly one, at the root
  unit's pre-forward hook (plait's FSDPState._pre_forward, dynamo-disabled by design: the
  engine's hooks run outside the graph). The root MLP.forward then runs eagerly (dynamo
  skips a frame whose loop would break at every unit's hooks) and each Block.forward frame
  compiles on its own: two graphs of exactly [linear, tanh] (the whole block), four ops
  captured, none recompiled after the first step;
- warnings: none from plait (warnings.catch_warnings in each rank, and plait's loggers at
  WARNING), and none at all from torch either in this run;
- parity: losses every step and parameters at the end equal the eager wrapper's, atol 1e-6
  (float32; "aot_eager" runs the same aten ops, so only the order of a few additions can
  differ: in this run they are bitwise equal).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch.nn.functional as F

from plait.fsdp import ShardingStrategy
from plait.testing import distributed
from tests.fsdp.common import (
    PER_RANK,
    assert_full_params_close,
    batch,
    build,
    make_opt,
    mine,
    world,
)
from tests.fsdp1.common import wrap
from tests.log_records import WarningRecords

STEPS = 4


def _plait_made(w: warnings.WarningMessage) -> bool:
    return "/plait/" in w.filename.replace("\\", "/") or "plait" in str(w.message).lower()


@distributed([2])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP],
                         ids=lambda s: s.name)
def test_compiled_fsdp1_trains_like_eager(strategy):
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    _, rank, n = world()
    torch._dynamo.reset()
    counters.clear()
    graphs: list[list[str]] = []
    aot_eager = lookup_backend("aot_eager")

    def backend(gm, example_inputs):  # aot_eager, logging each graph's ops
        graphs.append([getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                       if n.op == "call_function"])
        return aot_eager(gm, example_inputs)

    eager = wrap(build("mlp"), sharding_strategy=strategy)
    model = wrap(build("mlp"), sharding_strategy=strategy)
    compiled = torch.compile(model, backend=backend)
    opts = make_opt(eager.parameters()), make_opt(model.parameters())
    records = WarningRecords()
    plait_log = logging.getLogger("plait")
    plait_log.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                x, y = batch("mlp", step, n * PER_RANK)
                losses = []
                for m, opt in zip((eager, compiled), opts):
                    loss = F.cross_entropy(m(mine(x, rank)), mine(y, rank))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach())
                torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0,
                                           msg=lambda m, s=step: f"step {s}: {m}")
    finally:
        plait_log.removeHandler(records)
    assert_full_params_close(model, eager, atol=1e-6, rtol=0, what=f"compiled {strategy.name} after {STEPS} steps")

    breaks = dict(counters["graph_break"])
    print(f"{strategy.name}: graph breaks {sum(breaks.values())}, graphs {graphs}, stats {dict(counters['stats'])}")
    assert sum(breaks.values()) == 1, breaks
    assert all("plait.fsdp.state" in reason and "FSDPState._pre_forward" in reason for reason in breaks), breaks
    assert graphs == [["linear", "tanh"]] * 2, graphs  # each block whole, no recompilation after step 0
    assert counters["stats"]["unique_graphs"] == 2
    assert not [w for w in caught if _plait_made(w)], [str(w.message) for w in caught]
    assert caught == [], [f"{w.category.__name__}: {w.message}" for w in caught]
    assert records.records == [], [r.getMessage() for r in records.records]
