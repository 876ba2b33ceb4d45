"""The family of dense and expert-attention variants (apps/family.py) as a figure: held-out bits per
byte against what each variant pays for it. Notebook 09 draws it from figures/family.json."""

from __future__ import annotations

from matplotlib.figure import Figure

# what a variant pays, as the figure's x axes: (JSON key, axis label, scale)
COSTS = {
    "kv": ("kv_bytes_per_token_measured", "KV bytes per token, held by the paged cache", 1.0),
    "flops": ("attention_flops_per_token", "attention FLOPs per token (thousands), training context", 1e-3),
    "params": ("parameters", "parameters (millions)", 1e-6),
    "speed": ("decode_tokens_per_second", "decode tokens / s on this CPU (paged cache)", 1.0),
}
COLORS = {
    "dense": "#7f7f7f",
    "expert_topk": "#1f77b4",
    "expert_threshold": "#17becf",
    "dense_kv_matched": "#d62728",
    "dense_flops_matched": "#ff7f0e",
}
LABEL_OFFSETS = {"dense_kv_matched": (6, -16)}  # points: below, where it would overlap its neighbour


def plot_family(family: dict, costs=("kv", "flops"), width: float = 9.5) -> Figure:
    """One panel per cost: every variant's mean bits per byte over seeds (error bar: one sample
    standard deviation) against that cost. Lower is better on y."""
    for cost in costs:
        if cost not in COSTS:
            raise ValueError(f"cost={cost!r} is not one of {tuple(COSTS)}")
    fig = Figure(figsize=(width, 4.0), layout="constrained")
    axes = fig.subplots(1, len(costs), squeeze=False)[0]
    seeds = len(family["budget"]["seeds"])
    for ax, cost in zip(axes, costs):
        key, label, scale = COSTS[cost]
        for name, v in family["variants"].items():
            ax.errorbar(
                v[key] * scale,
                v["bits_per_byte_mean"],
                yerr=v["bits_per_byte_sd"],
                fmt="o",
                ms=7,
                capsize=4,
                color=COLORS.get(name, "black"),
                label=name,
            )
            ax.annotate(
                name,
                (v[key] * scale, v["bits_per_byte_mean"]),
                textcoords="offset points",
                xytext=LABEL_OFFSETS.get(name, (6, 6)),
                fontsize=10,
            )
        ax.set_xlabel(label)
        ax.set_ylabel(f"held-out bits per byte (mean of {seeds} seeds)")
        ax.grid(alpha=0.3)
        ax.margins(x=0.25, y=0.2)
    budget = family["budget"]
    fig.suptitle(
        f"same recipe, {budget['tokens_per_run'] / 1e6:.2f} M training bytes each: lower is better",
        fontsize=11,
    )
    return fig
