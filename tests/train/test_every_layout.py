"""Every dp_replicate x dp_shard x tp x pp layout of 8 ranks is accounted for: it trains like
one process, or `plait.train.layout.check` refuses it naming the numbers.

The 20 ordered factorisations of 8 into (dp_replicate, dp_shard, tp, pp) on the tiny config
(2 layers, 8 heads / 4 KV heads, vocabulary 256, global batch 8 of 32 tokens), unchanged:
  - 15 fit (tp in 1, 2, 4: it divides 8 heads, 4 KV heads and 256; pp in 1, 2: it divides 2
    layers, and the per-replica batch 8 / dp splits into pp microbatches), among them FSDP x TP x
    PP (1, 2, 2, 2), HSDP x PP (2, 2, 1, 2), HSDP x TP (2, 2, 2, 1) and DDP x TP x PP (2, 1, 2, 2);
    each runs 3 steps on one 8-rank pool and its global loss and grad norm every step and its
    held-out loss at step 3 are compared with a 1-rank run of the same 3 steps (tolerance: test_parity's, rtol 1e-5 / atol 1e-5).
  - 5 do not: tp 8 (4 KV heads), pp 4 and pp 8 (2 layers); check() raises a ValueError
    naming the model figure and the degree.
HSDP x TP x PP needs every one of the four dims >= 2, 16 ranks: it is not a layout of 8; only its
resolution on 16 is checked here (training it would need a 16-rank pool).
The Llama has no biases, so no TP-sharded 1-D parameter is exercised here (norm weights are
replicated over tp; with sequence parallel their grads are Partial, which test_parity covers).
"""

from __future__ import annotations

import itertools

import pytest

from plait.train import apply_overrides, load
from plait.train.layout import check
from tests.train.test_parity import check as check_parity

WORLD = 8
BASE = ("--training.steps", "3")
DIMS = ("dp_replicate", "dp_shard", "tp", "pp")
LAYOUTS = [c for c in itertools.product((1, 2, 4, 8), repeat=4) if c[0] * c[1] * c[2] * c[3] == WORLD]
# why each one the tiny model cannot take is refused: (layout, the words check() must say)
REFUSED = {
    (1, 1, 8, 1): r"n_kv_heads\(4\) is not divisible by tp\(8\)",
    (1, 1, 1, 8): r"n_layers\(2\) is not divisible into 8 pipeline stages",
    (2, 1, 1, 4): r"n_layers\(2\) is not divisible into 4 pipeline stages",
    (1, 2, 1, 4): r"n_layers\(2\) is not divisible into 4 pipeline stages",
    (1, 1, 2, 4): r"n_layers\(2\) is not divisible into 4 pipeline stages",
}
FITS = [c for c in LAYOUTS if c not in REFUSED]


def _overrides(layout: tuple[int, ...]) -> list[str]:
    return [arg for name, v in zip(DIMS, layout) for arg in (f"--parallel.{name}", str(v))]


def _id(layout: tuple[int, ...]) -> str:
    return "x".join(f"{name}{v}" for name, v in zip(DIMS, layout))


def test_every_layout_is_listed():
    assert len(LAYOUTS) == 20 and len(FITS) == 15  # C(6, 3) ways to spread 2**3 over 4 dims
    assert {(1, 2, 2, 2), (2, 2, 1, 2), (2, 1, 2, 2), (2, 2, 2, 1)} <= set(FITS)


@pytest.mark.parametrize("layout", list(REFUSED), ids=_id)
def test_layout_the_model_cannot_take_is_refused(layout):
    config = apply_overrides(load("tiny"), [*BASE, *_overrides(layout)])
    with pytest.raises(ValueError, match=REFUSED[layout]):
        check(config, WORLD)


@pytest.mark.parametrize("layout", FITS, ids=_id)
def test_layout_trains_like_one_process(layout):
    check(apply_overrides(load("tiny"), [*BASE, *_overrides(layout)]), WORLD)  # fits, before any rank
    check_parity(WORLD, _overrides(layout), base=BASE, val_steps=(3,), learns=0.1)


def test_hsdp_x_tp_x_pp_needs_16_ranks():
    config = apply_overrides(load("tiny"), [*BASE, *_overrides((2, 2, 2, 2))])
    _, dims = check(config, 16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.microbatches) == (2, 2, 2, 2, 2)
    with pytest.raises(ValueError, match=r"= 16 != world_size\(8\)"):
        check(config, WORLD)
