"""Comparisons paired by seed (stats.paired_difference, paired_ratio, sign_of): each equals its
plain definition on fresh random numbers, pairs by seed whatever the order, and the paired t-test
keeps its 5% error rate."""

import math
import random
import statistics

import pytest

from moekv_ref.stats import mean_sd_text, paired_difference, paired_ratio, sign_of, t_quantile_975


def test_the_paired_difference_is_the_t_interval_of_the_per_seed_differences():
    """Against the textbook formula, with seeds given in different orders and one seed only one side
    has (left out)."""
    rng = random.Random(7)
    a = {seed: rng.gauss(3.0, 0.3) for seed in range(6)}
    b = {seed: a[seed] - 0.1 + rng.gauss(0, 0.02) for seed in reversed(range(5))}
    d = [a[s] - b[s] for s in range(5)]
    half = t_quantile_975(4) * statistics.stdev(d) / math.sqrt(5)
    result = paired_difference(a, b)
    assert result["n"] == 5
    assert result["mean"] == pytest.approx(statistics.fmean(d), abs=1e-12)
    assert result["ci95"] == pytest.approx(
        [statistics.fmean(d) - half, statistics.fmean(d) + half], abs=1e-12
    )
    ratio = paired_ratio(a, b)
    assert ratio["mean"] == pytest.approx(statistics.fmean(a[s] / b[s] for s in range(5)), abs=1e-12)


def test_pairing_sees_a_small_steady_difference_that_the_spread_across_seeds_hides():
    """Seeds differ by far more than the two variants do, but the variant is 0.1 worse on every seed:
    the paired interval lies above zero, where the old rule (twice the larger spread) said "ties"."""
    rng = random.Random(11)
    base = {seed: 3.0 + rng.gauss(0, 0.5) for seed in range(3)}
    worse = {seed: value + 0.1 + rng.gauss(0, 0.005) for seed, value in base.items()}
    assert abs(statistics.fmean(worse.values()) - statistics.fmean(base.values())) < 2 * statistics.stdev(
        base.values()
    )
    assert sign_of(paired_difference(worse, base)) == 1
    assert sign_of(paired_difference(base, worse)) == -1


def test_the_paired_test_rejects_a_true_zero_about_five_percent_of_the_time():
    """4,000 fresh pairs of 3 seeds with no true difference: the interval leaves zero out in 5% of
    them (within 1.5 points); one value gives no interval and no verdict."""
    rng = random.Random(20261207)
    rejected = 0
    for _ in range(4000):
        shared = [rng.gauss(0, 1) for _ in range(3)]
        a = {s: shared[s] + rng.gauss(0, 0.1) for s in range(3)}
        b = {s: shared[s] + rng.gauss(0, 0.1) for s in range(3)}
        rejected += sign_of(paired_difference(a, b)) != 0
    assert abs(rejected / 4000 - 0.05) < 0.015
    assert sign_of(paired_difference({0: 1.0}, {0: 0.0})) == 0


def test_a_table_prints_the_mean_and_the_sample_standard_deviation():
    summary = {"n": 3, "mean": 2.0, "sd": statistics.stdev([1.0, 2.0, 3.0]), "ci95": [0, 0]}
    assert mean_sd_text(summary) == "2.000 ± 1.000"  # the population s.d. would print 0.816
    assert mean_sd_text({"n": 1, "mean": 2.0, "sd": math.nan, "ci95": [0, 0]}) == "2.000"
