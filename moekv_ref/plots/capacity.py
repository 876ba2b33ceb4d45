"""What a per-row KV budget costs in quality (apps/capacity.py) as a figure: held-out bits per byte
against the KV bytes per token the rows actually hold, every (variant, policy, budget) a point and each
variant's frontier a line. Notebook 10 and `python -m moekv_ref capacity` draw it from
figures/capacity.json. And what a budget did to one layer's rows (`plot_budget_map`, of
analysis.budget_map), notebook 10's map."""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..analysis import BUDGET_MAP_CODES
from .routing import ROUTED_COLOUR

COLORS = {
    "dense": "#7f7f7f",
    "expert_topk": "#1f77b4",
    "expert_topk_capacity": "#2ca02c",
    "expert_choice": "#d62728",
}
MARKERS = {"none": "*", "drop": "v", "window": "s", "heavy_hitter": "o", "router_score": "D"}
# what a setting pays, as the x axes: (JSON key, axis label, scale)
COSTS = {
    "kv": ("kv_bytes_per_token", "KV bytes per token held at the window's end", 1.0),
    "flops": ("attention_flops_per_token", "attention FLOPs per token (thousands)", 1e-3),
}


# Bytes held within this fraction of each other count as one size: policies at the same B hold a few
# bytes apart (a row routed fewer than B tokens holds them all), and the frontier should not step
# through a worse policy that happens to hold 0.1% less.
SAME_SIZE = 0.02


def frontier_rows(table: list[dict], variant: str) -> list[dict]:
    """The variant's settings that no setting of it with fewer bytes held (or as many, within
    SAME_SIZE) beats, ascending in bytes."""
    mine = sorted(
        (r for r in table if r["variant"] == variant),
        key=lambda r: (r["kv_bytes_per_token"], r["bits_per_byte_mean"]),
    )
    front = []
    for row in mine:
        if front and row["bits_per_byte_mean"] >= front[-1]["bits_per_byte_mean"]:
            continue  # beaten by a smaller setting
        while front and front[-1]["kv_bytes_per_token"] >= row["kv_bytes_per_token"] * (1 - SAME_SIZE):
            front.pop()  # the same size, and worse
        front.append(row)
    return front


def plot_capacity(study: dict, costs=("kv", "flops"), variants=None, width: float = 9.5) -> Figure:
    """One panel per cost: each setting's mean bits per byte over seeds (error bar: one sample
    standard deviation) against that cost, colour by variant, marker by policy (a star: no budget); on the KV
    panel, each variant's frontier as a line. Lower and further left is better."""
    for cost in costs:
        if cost not in COSTS:
            raise ValueError(f"cost={cost!r} is not one of {tuple(COSTS)}")
    names = list(study["variants"]) if variants is None else list(variants)
    fig = Figure(figsize=(width, 4.4), layout="constrained")
    axes = fig.subplots(1, len(costs), squeeze=False, sharey=True)[0]
    seeds = len(study["budget"]["seeds"])
    for ax, cost in zip(axes, costs):
        key, label, scale = COSTS[cost]
        for row in study["table"]:
            if row["variant"] not in names:
                continue
            ax.errorbar(
                row[key] * scale,
                row["bits_per_byte_mean"],
                yerr=row["bits_per_byte_sd"],
                fmt=MARKERS[row["policy"]],
                ms=9 if row["policy"] == "none" else 5,
                capsize=2,
                color=COLORS.get(row["variant"], "black"),
                alpha=0.85,
            )
        if cost == "kv":
            for name in names:
                front = frontier_rows(study["table"], name)
                ax.plot(
                    [r[key] * scale for r in front],
                    [r["bits_per_byte_mean"] for r in front],
                    "-",
                    color=COLORS.get(name, "black"),
                    lw=1.5,
                    label=name,
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out bits per byte (mean of {seeds} seeds)")
    for policy, marker in MARKERS.items():
        axes[-1].plot([], [], marker, color="black", ls="", label="no budget" if policy == "none" else policy)
    handles, labels = [], []
    for ax in axes:
        these_handles, these_labels = ax.get_legend_handles_labels()
        handles += these_handles
        labels += these_labels
    fig.legend(handles, labels, loc="outside right center", fontsize=10)
    context = study["budget"]["context"]
    fig.suptitle(
        f"budgets per (sequence, layer, expert) row, windows of {context} bytes: lower is better", fontsize=11
    )
    return fig


# budget_map's codes, in BUDGET_MAP_CODES' order: not routed, kept, evicted, refused
BUDGET_MAP_COLOURS = ("#f4f4f4", ROUTED_COLOUR, "#f6ad55", "#c53030")


def plot_budget_map(codes, layer: int, budget, width: float = 9.5) -> Figure:
    """One layer under a row budget (analysis.budget_map's codes, (E, T)): experts as rows, positions
    as columns, each cell not routed, kept, evicted or refused; at the right of each row, the tokens
    it keeps at the end and the tokens routed to it."""
    codes = np.asarray(codes)
    num_experts, num_tokens = codes.shape
    fig = Figure(figsize=(width, 1.2 + 0.32 * num_experts), layout="constrained")
    ax = fig.subplots()
    ax.imshow(
        codes,
        aspect="auto",
        cmap=ListedColormap(BUDGET_MAP_COLOURS),
        vmin=0,
        vmax=len(BUDGET_MAP_CODES) - 1,
        interpolation="nearest",
    )
    ax.set_yticks(range(num_experts), [f"e{e}" for e in range(num_experts)])
    ax.set_xticks(range(0, num_tokens, 16))
    ax.set_xticks(np.arange(-0.5, num_tokens), minor=True)
    ax.set_yticks(np.arange(-0.5, num_experts), minor=True)
    ax.grid(which="minor", axis="y", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    kept = (codes == BUDGET_MAP_CODES.index("kept")).sum(1)
    routed = (codes != BUDGET_MAP_CODES.index("not routed")).sum(1)
    for e in range(num_experts):
        ax.text(num_tokens, e, f" {kept[e]} of {routed[e]}", va="center", fontsize=10)
    ax.text(num_tokens, -0.6, " kept of routed", va="bottom", fontsize=10)
    ax.set_xlabel("position in the sequence (one byte-token per column)")
    ax.set_ylabel("attention expert")
    limit = budget.limit_of_layer(layer)
    ax.set_title(
        f"layer {layer}, {budget.policy}, at most B = {limit} tokens per row: "
        f"what each token became in each expert's row",
        fontsize=11,
    )
    counts = np.bincount(codes.reshape(-1), minlength=len(BUDGET_MAP_CODES))
    handles = [
        Patch(facecolor=colour, edgecolor="grey", label=f"{name} ({count})")
        for name, colour, count in zip(BUDGET_MAP_CODES, BUDGET_MAP_COLOURS, counts)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=10, frameon=False)
    return fig
