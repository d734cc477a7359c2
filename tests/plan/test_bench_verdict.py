"""The plan benchmark's verdict statistic: how often the predicted best stays among the best
two when each layout's runs are resampled (benchmarks/bench_plan.py). Pure logic, no runs."""

from benchmarks.bench_plan import _resampled_best_two


def test_separated_layouts_give_a_verdict_that_stands():
    runs = {0: [100.0, 101.0, 99.0], 1: [110.0, 111.0], 2: [120.0, 121.0, 119.0], 3: [140.0]}
    assert _resampled_best_two(runs, 0, 500) == 1.0  # fastest
    assert _resampled_best_two(runs, 1, 500) == 1.0  # second
    assert _resampled_best_two(runs, 2, 500) == 0.0  # every draw of 0 and 1 is faster
    assert _resampled_best_two(runs, 3, 500) == 0.0


def test_layouts_closer_than_their_spread_share_the_best_two():
    # four layouts whose runs interleave: each is among the best two in some draws, none in all,
    # and the shares add up to two per draw
    runs = {k: [100.0 + k + 8 * j for j in range(5)][::(-1) ** k] for k in range(4)}
    shares = [_resampled_best_two(runs, k, 2000) for k in range(4)]
    assert all(0.2 < s < 0.8 for s in shares), shares
    assert abs(sum(shares) - 2.0) < 1e-9
    assert shares == [_resampled_best_two(runs, k, 2000) for k in range(4)]  # seeded


def test_a_single_run_layout_counts_by_its_one_time():
    assert _resampled_best_two({0: [100.0], 1: [90.0], 2: [80.0]}, 0, 100) == 0.0
    assert _resampled_best_two({0: [100.0], 1: [90.0]}, 0, 100) == 1.0
