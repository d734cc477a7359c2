"""The config: TOML + overrides, the shipped configs, and errors that name the numbers —
all checked without a process group (plait.train.check is pure)."""

from __future__ import annotations

import pytest

from plait.train import apply_overrides, check, from_dict, load
from plait.train.cli import main


def layout(world: int, *overrides: str):
    return check(apply_overrides(load("tiny"), list(overrides)), world)[1]


def test_shipped_configs_resolve_and_round_trip_through_toml(tmp_path):
    for name in ("tiny", "small", "100m"):
        config = load(name)
        path = tmp_path / f"{name}.toml"
        path.write_text(config.to_toml())
        assert load(path) == config
    args, _ = check(load("100m"), 8)
    assert 95e6 < args.num_params() < 110e6  # "about 100M" for planning


def test_overrides_are_typed_and_minus_one_is_the_rest():
    config = apply_overrides(load("tiny"), ["--parallel.tp", "2", "--parallel.pp=2", "--training.lr", "1e-3",
                                            "--checkpoint.export-safetensors", "--parallel.pp_layers", "1,1"])
    assert (config.parallel.tp, config.parallel.pp, config.training.lr) == (2, 2, 1e-3)
    assert config.checkpoint.export_safetensors is True and config.parallel.pp_layers == [1, 1]
    dims = check(config, 8)[1]
    assert (dims.dp_shard, dims.tp, dims.pp, dims.microbatches) == (2, 2, 2, 2)
    assert dims.stage_layers == ((0,), (1,))


@pytest.mark.parametrize("world, overrides, message", [
    (8, ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.pp", "4"],
     r"dp_shard\(2\) \* tp\(2\) \* pp\(4\) = 16 != world_size\(8\)"),
    (6, ["--parallel.tp", "4"], r"dp_shard\(\?\) \* tp\(4\): the other dims multiply to 4, which does not divide world_size\(6\)"),
    (3, ["--parallel.tp", "3", "--parallel.dp_shard", "1"], r"n_heads\(8\) is not divisible by tp\(3\)"),
    (8, ["--parallel.pp", "8", "--parallel.dp_shard", "1"],
     r"n_layers\(2\) is not divisible into 8 pipeline stages"),
    (4, ["--parallel.pp", "2", "--parallel.pp_layers", "1,2"],
     r"pp_layers \[1, 2\] must give 2 stages .* summing to n_layers\(2\); sum is 3"),
    (3, ["--parallel.dp_shard", "3"], r"batch_size\(8\) is not divisible by the data-parallel degree .* = 3"),
    (4, ["--parallel.pp", "2", "--parallel.microbatches", "3"],
     r"batch_size\(8\) / dp\(2\) = 4 is not divisible by microbatches\(3\)"),
    (4, ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble"], r"virtual_stages >= 2 \(got 1\)"),
    (4, ["--parallel.pp", "2", "--parallel.pp_schedule", "Nope"], r"unknown pp_schedule 'Nope'"),
    (2, ["--model.n_layers", "4", "--parallel.pp", "2", "--parallel.pp_schedule", "Looped1F1B",
         "--parallel.virtual_stages", "2", "--parallel.microbatches", "1"],  # a known name, checked
     r"Looped1F1B takes microbatches in rounds of microbatches_per_round\(2\)"),
    (2, ["--parallel.tp", "2", "--training.seq_len", "33"], r"seq_len\(33\) is not divisible by tp\(2\)"),
])
def test_layout_errors_name_the_numbers(world, overrides, message):
    with pytest.raises(ValueError, match=message):
        layout(world, *overrides)


def test_unknown_keys_and_bad_values_are_refused():
    with pytest.raises(ValueError, match=r"unknown key parallel.tpp; \[parallel\] has dp_replicate"):
        apply_overrides(load("tiny"), ["--parallel.tpp", "2"])
    with pytest.raises(TypeError, match=r"parallel.tp takes int, got 'two'"):
        apply_overrides(load("tiny"), ["--parallel.tp", "two"])
    with pytest.raises(ValueError, match=r"unknown config section \[trainin\]"):
        from_dict({"trainin": {"steps": 1}})
    with pytest.raises(ValueError, match=r"no config file 'nope' and no shipped config"):
        load("nope")


def test_cli_reports_a_layout_error_before_starting_a_group(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.pp", "4"]) == 2
    assert "dp_shard(2) * tp(2) * pp(4) = 16 != world_size(8)" in capsys.readouterr().err


def test_print_config_prints_the_resolved_layout_and_toml(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--config", "small", "--parallel.tp", "2", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# dp_replicate(1) x dp_shard(2) x tp(2) x pp(1) = 4 ranks")
    assert "[parallel]\ndp_replicate = 1\ndp_shard = -1\ntp = 2\n" in out
