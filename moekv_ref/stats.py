"""The statistics a study reports: a mean over seeds with its sample standard deviation and
Student-t 95% interval, and comparisons paired by seed (a ratio, or a difference with its t-test).

Python's statistics module and torch have no inverse CDF of Student's t, so its 0.975 quantile
comes from the standard table for 1 to 30 degrees of freedom and, beyond, from the Cornish-Fisher
expansion around the normal's 1.959964 (Abramowitz and Stegun 26.7.5), within 0.001 from 30 on.
"""

from __future__ import annotations

import math
import statistics

from .validation import check_int

T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
Z_975 = 1.959964


def t_quantile_975(df: int) -> float:
    """Student's t 0.975 quantile at df degrees of freedom (module docstring)."""
    df = check_int("df", df, 1, 10**9, meaning="degrees of freedom")
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci95(values) -> dict:
    """{"n", "mean", "sd" (sample), "ci95": [low, high]} of values (at least two for an interval;
    one gives NaN bounds), a Student-t interval: for paired differences or ratios, give the
    per-seed ones."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": math.nan, "sd": math.nan, "ci95": [math.nan, math.nan]}
    mean = statistics.fmean(values)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": math.nan, "ci95": [math.nan, math.nan]}
    sd = statistics.stdev(values)
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half]}


def paired_ratio(values: dict, over: dict) -> dict:
    """Per-seed ratios values[s] / over[s] (seed -> number), over the seeds in both with over[s] > 0:
    their mean with its Student-t 95% interval (mean_ci95), n stated."""
    seeds = sorted(s for s in values if s in over and over[s] > 0)
    return mean_ci95([values[s] / over[s] for s in seeds])


def paired_difference(values: dict, over: dict) -> dict:
    """The paired test where seeds share data: the per-seed differences values[s] - over[s] (seed ->
    number, the seeds in both), their mean with its Student-t 95% interval (mean_ci95), n stated.
    The difference is told apart from zero, a two-sided paired t-test at 5%, when the interval
    leaves zero out (sign_of)."""
    seeds = sorted(s for s in values if s in over)
    return mean_ci95([values[s] - over[s] for s in seeds])


def sign_of(summary: dict) -> int:
    """+1 when a summary's 95% interval lies above zero, -1 when below, 0 when it holds zero or is
    not defined (fewer than two values)."""
    low, high = summary["ci95"]
    if low > 0:
        return 1
    if high < 0:
        return -1
    return 0


def mean_sd_text(summary: dict, digits: int = 3) -> str:
    """ "mean ± s.d." as the tables print a mean_ci95 summary (the sample s.d.; the mean alone for
    one value)."""
    if summary["n"] < 2:
        return f"{summary['mean']:.{digits}f}"
    return f"{summary['mean']:.{digits}f} ± {summary['sd']:.{digits}f}"
