"""The reservation study (apps/bench_reservation.py) as a figure: each strategy's goodput over the
clairvoyant bound's, paired by seed, with its 95% interval, one panel per KV memory setting. Drawn
from figures/reservation_study.json by `python -m moekv_ref figures`."""

from __future__ import annotations

from matplotlib.figure import Figure

COLORS = {
    "worst_case": "#7f7f7f",
    "optimistic": "#d62728",
    "calibrated": "#1f77b4",
    "clairvoyant": "#2ca02c",
}


def paired_seeds(tasks, memory: float) -> set:
    """The seeds every strategy run at this memory has run: means and ratios are over them alone, so
    that an unfinished study compares like with like (a strategy not run there at all is left out)."""
    by_strategy = [{t["seed"] for t in tasks if t["strategy"] == s and t["memory"] == memory} for s in COLORS]
    return set.intersection(*[seeds for seeds in by_strategy if seeds] or [set()])


def plot_reservation(result: dict, gate: float, pass_mark: float) -> Figure:
    """One panel per KV memory setting: each strategy's goodput over clairvoyant's, paired by seed
    (the JSON's summary: the mean of per-seed ratios and its 95% interval), with the study's two
    lines: the gate (worst case at most `gate` of the bound) and the pass mark (bench_reservation's
    GATE and PASS_MARK)."""
    memories = result["design"]["memory_multiples"]
    fig = Figure(figsize=(3.3 * len(memories), 4.2))  # three panels within a notebook's 1,000 px
    axes = fig.subplots(1, len(memories), sharey=True, squeeze=False)[0]
    blocks = result["scales"]["working_set_blocks"]
    for ax, memory in zip(axes, memories):
        rows = result["summary"][f"{memory:g}"]["strategies"]
        names = [name for name in COLORS if rows.get(name, {}).get("n", 0) >= 2]
        ratios = [rows[name]["over_clairvoyant"] for name in names]
        means = [r["mean"] for r in ratios]
        low = [r["mean"] - r["ci95"][0] for r in ratios]
        high = [r["ci95"][1] - r["mean"] for r in ratios]
        ax.bar(names, means, color=[COLORS[name] for name in names], yerr=[low, high], capsize=4)
        ax.axhline(pass_mark, color="black", linewidth=1, linestyle="--", label=f"pass mark {pass_mark:.2f}")
        ax.axhline(gate, color="grey", linewidth=1, linestyle=":", label=f"gate {gate:.2f}")
        n = min((rows[name]["n"] for name in names), default=0)
        if not names:
            ax.text(0.5, 0.5, "not run yet", transform=ax.transAxes, ha="center", fontsize=10)
            ax.set_xticks([])
        ax.set_title(
            f"{memory:g} x working set\n({memory * blocks / 1e3:.0f}k blocks a GPU), n={n}", fontsize=10
        )
        ax.tick_params(axis="x", labelrotation=20)
    axes[0].set_ylim(0.6, 1.05)
    axes[0].set_ylabel("goodput / clairvoyant's (paired)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=10, loc="lower center", ncol=2)  # below the panels: bars fill them
    fig.suptitle("Reservation strategies on 8 simulated H200s (mean over seeds, 95% interval)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
