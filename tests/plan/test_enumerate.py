"""Enumeration is plait train's own rules: what it keeps, `check` accepts; what it rejects
names the numbers. Pure logic: no process starts."""

from __future__ import annotations

import shlex

import pytest

from plait.plan.layouts import enumerate_layouts, factorizations
from plait.train.cli import parse
from plait.train.config import apply_overrides, load
from plait.train.layout import check


def test_factorizations_are_every_ordered_product():
    assert sorted(factorizations(4, 2)) == [(1, 4), (2, 2), (4, 1)]
    assert len(list(factorizations(8, 4))) == 20  # C(3 + 3, 3): the exponent 3 over 4 slots
    assert all(a * b * c * d == 12 for a, b, c, d in factorizations(12, 4))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_kept_layouts_start_and_rejected_ones_say_why(world):
    config = load("tiny")
    kept, rejected = enumerate_layouts(config, world)
    assert kept and len(kept) + len(rejected) == len({(k.choice) for k in kept} | {r.choice for r in rejected})
    for layout in kept:
        _, dims = check(layout.config, world)
        assert dims == layout.dims and dims.world_size == world
    for r in rejected:
        with pytest.raises(ValueError):
            check(r.choice.apply(config), world)
        assert any(ch.isdigit() for ch in r.reason), r.reason


def test_heads_that_do_not_split_are_rejected_with_the_numbers():
    config = apply_overrides(load("tiny"), ["--model.name", "tiny3", "--model.n_heads", "6",
                                            "--model.n_kv_heads", "3", "--training.batch_size", "12"])
    kept, rejected = enumerate_layouts(config, 4)
    reasons = {r.reason for r in rejected if r.choice.tp == 4}
    assert any("n_heads(6)" in r and "tp(4)" in r for r in reasons), reasons
    assert all(k.choice.tp != 4 for k in kept)


def test_layers_and_microbatches_rejections_carry_numbers():
    kept, rejected = enumerate_layouts(apply_overrides(load("tiny"), ["--training.batch_size", "4"]), 4)
    reasons = [r.reason for r in rejected]
    assert any("n_layers(2) is not divisible into 4 pipeline stages" in r for r in reasons)  # pp 4
    assert any("= 2 is not divisible by microbatches(4)" in r for r in reasons)  # pp 2 x dp 2, m 4


def test_the_train_command_parses_back_to_the_same_layout():
    from plait.plan.planner import train_command

    kept, _ = enumerate_layouts(load("tiny"), 4)
    for layout in kept[:40]:
        cmd = shlex.split(train_command("tiny", 4, ["--training.steps", "5"], layout))
        argv = cmd[cmd.index("--config"):]
        config, _ = parse(argv)
        assert check(config, 4)[1] == layout.dims
        assert config.activation_checkpoint.mode == layout.choice.ac_mode
        assert config.training.steps == 5


def test_train_auto_takes_the_planners_best(monkeypatch, capsys):
    from plait.plan.planner import plan
    from plait.train.cli import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--config", "tiny", "--parallel.auto", "true", "--print-config"]) == 0
    out = capsys.readouterr().out
    best = plan(load("tiny"), 4)[0][0]
    assert f"--parallel.auto chose {best.layout.choice.describe()} of 4 ranks" in out
    assert f"dp_replicate = {best.layout.dims.dp_replicate}" in out and "auto = false" in out


def test_cp_and_hsdp_tp_are_proposed():
    kept, _ = enumerate_layouts(load("tiny"), 8, ac_modes=("none",))
    shapes = {(k.choice.dp_replicate, k.choice.dp_shard, k.choice.cp, k.choice.tp, k.choice.pp) for k in kept}
    assert {(1, 1, 8, 1, 1), (1, 2, 2, 2, 1), (2, 2, 1, 2, 1), (2, 1, 2, 2, 1),
            (1, 1, 2, 2, 2)} <= shapes
    cp4 = next(k for k in kept if (k.choice.cp, k.choice.dp_shard) == (4, 2))
    assert cp4.dims.cp == 4 and "--parallel.cp" in cp4.choice.overrides() and "C4" in cp4.choice.describe()


def test_cp_rejections_are_layout_checks_with_the_numbers():
    # seq_len 12: cp 4 needs 12 % 8; cp 2 x tp 4 under SP needs 12 / 2 = 6 % 4
    kept, rejected = enumerate_layouts(apply_overrides(load("tiny"), ["--training.seq_len", "12"]), 8,
                                       ac_modes=("none",))
    reasons = {r.reason for r in rejected}
    assert any("seq_len(12) is not divisible by 2 * cp(4) = 8" in r for r in reasons), reasons
    assert any("seq_len(12) / cp(2) = 6 is not divisible by tp(4)" in r for r in reasons), reasons
    assert all(k.choice.cp in (1, 2) for k in kept)
    assert any(k.choice.cp == 2 and k.choice.tp == 4 and not k.choice.sequence_parallel for k in kept)
