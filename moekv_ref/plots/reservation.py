"""The reservation study (apps/bench_reservation.py) as a figure: each strategy's goodput per GPU,
its mean over seeds with the 95% interval of the mean, one panel per KV memory setting. Drawn from
figures/reservation_study.json by `python -m moekv_ref figures`."""

from __future__ import annotations

from matplotlib.figure import Figure

from ..stats import mean_ci95

COLORS = {
    "worst_case": "#7f7f7f",
    "optimistic": "#d62728",
    "calibrated": "#1f77b4",
    "clairvoyant": "#2ca02c",
}


def paired_seeds(tasks, memory: float) -> set:
    """The seeds every strategy has run at this memory: means and ratios are over them alone, so that
    an unfinished study compares like with like."""
    by_strategy = [{t["seed"] for t in tasks if t["strategy"] == s and t["memory"] == memory} for s in COLORS]
    return set.intersection(*by_strategy)


def goodput_by_strategy(result: dict, memory: float) -> dict:
    """strategy -> stats.mean_ci95 of its goodput per GPU over the paired seeds, at one memory
    setting (newest_first's tasks: the main comparison)."""
    mains = [t for t in result["tasks"].values() if t.get("victim", "newest_first") == "newest_first"]
    seeds = paired_seeds(mains, memory)
    rows = {}
    for strategy in COLORS:
        values = [
            t["goodput_per_gpu"]
            for t in mains
            if t["strategy"] == strategy and t["memory"] == memory and t["seed"] in seeds
        ]
        if values:
            rows[strategy] = mean_ci95(values)
    return rows


def plot_reservation(result: dict) -> Figure:
    memories = result["design"]["memory_multiples"]
    fig = Figure(figsize=(5.2 * len(memories), 3.8))
    axes = fig.subplots(1, len(memories), sharey=True, squeeze=False)[0]
    blocks = result["scales"]["working_set_blocks"]
    for ax, memory in zip(axes, memories):
        rows = goodput_by_strategy(result, memory)
        names = list(rows)
        means = [rows[name]["mean"] for name in names]
        low = [rows[name]["mean"] - rows[name]["ci95"][0] if rows[name]["n"] > 1 else 0 for name in names]
        high = [rows[name]["ci95"][1] - rows[name]["mean"] if rows[name]["n"] > 1 else 0 for name in names]
        ax.bar(names, means, color=[COLORS[name] for name in names], yerr=[low, high], capsize=4)
        n = min((rows[name]["n"] for name in names), default=0)
        ax.set_title(
            f"KV per GPU {memory:g} x working set ({memory * blocks / 1e3:.0f}k blocks), n={n}", fontsize=10
        )
        ax.tick_params(axis="x", labelrotation=20)
    axes[0].set_ylabel("goodput per GPU (requests/s)")
    fig.suptitle("Reservation strategies on 8 simulated H200s (mean over seeds, 95% interval)", fontsize=11)
    fig.tight_layout()
    return fig
