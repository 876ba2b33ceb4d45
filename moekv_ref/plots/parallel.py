"""Drawings of expert parallelism, for notebook 07: bytes per decode step as the context grows,
where each token's K/V lives, per-rank pools over a run, expert placements compared, and the cost
model's projected step times (never stacked on a log axis). Matplotlib only; every function draws on
an Axes it is given and computes nothing the package does not test."""

from __future__ import annotations

import textwrap

import matplotlib
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

PLACEMENT_COLOURS = {
    "kv_with_expert": "tab:blue",
    "kv_with_sequence": "tab:red",
    "replicated_attention": "tab:green",
}


def draw_bytes_vs_context(ax, rows: list[dict]) -> None:
    """rows: parallel_measure.bytes_table results. Bytes per decode step against context, one line per placement."""
    for placement, colour in PLACEMENT_COLOURS.items():
        mine = sorted(
            (r["context"], r["bytes_per_decode_step"]) for r in rows if r["kv_placement"] == placement
        )
        if mine:
            x, y = zip(*mine)
            ax.plot(x, y, "o-", color=colour, label=placement)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("bytes per decode step, all ranks (B)")
    ax.set_title("what crosses between ranks per decode step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # beside the data, not on it
    ax.grid(alpha=0.3)


def draw_kv_locations(ax, location: np.ndarray, num_experts: int, world_size: int, title: str = "") -> None:
    """location: locality.kv_location_map, (L * E, T). Each cell coloured by the rank holding it."""
    location = np.asarray(location)
    colours = ["white"] + [matplotlib.colormaps["tab10"](r) for r in range(world_size)]
    ax.imshow(
        location + 1,
        cmap=ListedColormap(colours),
        vmin=0,
        vmax=world_size,
        aspect="auto",
        interpolation="nearest",
    )
    num_layers = location.shape[0] // num_experts
    ax.set_yticks([layer * num_experts + num_experts / 2 - 0.5 for layer in range(num_layers)])
    ax.set_yticklabels([f"layer {layer}" for layer in range(num_layers)])
    for layer in range(1, num_layers):
        ax.axhline(layer * num_experts - 0.5, color="black", linewidth=0.8)
    ax.set_xlabel("token position (tokens)")
    ax.set_ylabel("expert rows, 8 per layer")
    ax.set_title(title)
    handles = [Rectangle((0, 0), 1, 1, color=colours[r + 1]) for r in range(world_size)]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="gray"))
    ax.legend(
        handles,
        [f"K/V on rank {r}" for r in range(world_size)] + ["not routed there"],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=10,
        frameon=False,
    )  # beside the map: covers no cell


def draw_pool_use(ax, per_rank_steps: list[list[dict]], title: str = "") -> None:
    """per_rank_steps: parallel_measure.pool_table. Blocks used per rank after each step."""
    for rank, steps in enumerate(per_rank_steps):
        ax.plot([s["used_blocks"] for s in steps], "o-", label=f"rank {rank}", markersize=3)
    ax.axhline(per_rank_steps[0][0]["num_blocks"], color="gray", linestyle="--", label="pool size")
    ax.set_xlabel("step (0 = prefill, then decode steps)")
    ax.set_ylabel("blocks used on the rank (blocks)")
    # a long line wraps instead of running into the next panel's title
    ax.set_title("\n".join(textwrap.fill(line, 40) for line in title.split("\n")))
    ax.legend(
        fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False
    )  # below: covers no line


def draw_placement_comparison(axes, rows: list[dict]) -> None:
    """rows: locality.compare_placements. Left: ranks touched per token per layer; right: K/V
    imbalance (max / mean tokens per rank), grouped by world size."""
    world_sizes = sorted({r["world_size"] for r in rows})
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    width = 0.8 / len(strategies)
    for measure, ax, label, title in (
        (
            "ranks_touched_per_token_layer",
            axes[0],
            "ranks touched per token per layer",
            "ranks touched: fewer is less traffic",
        ),
        ("kv_imbalance_max_over_mean", axes[1], "K/V imbalance (max / mean)", "K/V imbalance: 1.0 is even"),
    ):
        for i, strategy in enumerate(strategies):
            values = [
                next(r[measure] for r in rows if r["world_size"] == w and r["strategy"] == strategy)
                for w in world_sizes
            ]
            ax.bar(np.arange(len(world_sizes)) + i * width, values, width, label=strategy)
        ax.set_xticks(np.arange(len(world_sizes)) + width * (len(strategies) - 1) / 2)
        ax.set_xticklabels([f"{w} ranks" for w in world_sizes])
        ax.set_ylabel(label)
        ax.set_title(title)
    # one legend under both panels, the figure's (the bars reach the top): anchored to one Axes, it
    # made constrained layout widen that Axes' box and opened a gap between the panels
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].figure.legend(
        handles, labels, fontsize=10, loc="outside lower center", ncol=len(strategies), frameon=False
    )


STEP_PARTS = {
    "attention_ms": ("attention", "tab:purple"),
    "experts_ms": ("FFN experts", "tab:orange"),
    "communication_ms": ("communication", "tab:gray"),
}


def draw_bytes_by_category(ax, row: dict) -> None:
    """row: one parallel_measure.bytes_table result. The bytes of one decode step by collective category,
    side by side on a linear axis, so a category that moves nothing shows as no bar."""
    categories = (
        "attention_dispatch",
        "attention_combine",
        "kv_context",
        "kv_new",
        "ffn_dispatch",
        "ffn_combine",
        "split_sizes",
    )
    values = [row["by_category"].get(c, 0) for c in categories]
    colours = ["tab:blue"] * 2 + ["tab:red"] * 2 + ["tab:orange"] * 2 + ["tab:gray"]
    ax.barh(np.arange(len(categories)), values, color=colours)
    ax.set_yticks(np.arange(len(categories)))
    ax.set_yticklabels(categories)
    ax.invert_yaxis()
    ax.set_xlabel("bytes per decode step, all ranks (B)")
    # two lines: the category labels narrow this panel, and a one-line title ran into its neighbour's
    ax.set_title(f"{row['kv_placement']}\n{row['world_size']} ranks, context {row['context']}")


def draw_projected_step(ax, projections: list[dict], title: str = "") -> None:
    """projections: costs.project_step(...).to_dict() rows of one link. For each (KV placement,
    context) the three parts of the projected step side by side (not stacked: the axis is log, where
    stacked heights would mislead) and the step, their sum, as a black tick above them."""
    width = 0.8 / len(STEP_PARTS)
    short = {
        "kv_with_expert": "K/V with\nexpert",
        "kv_with_sequence": "K/V with\nsequence",
        "replicated_attention": "replicated\nattention",
    }
    labels = [f"{short[r['kv_placement']]}\n{r['context'] // 1024}k" for r in projections]
    x = np.arange(len(projections))
    for i, (key, (name, colour)) in enumerate(STEP_PARTS.items()):
        ax.bar(x + (i - 1) * width, [r[key] for r in projections], width, color=colour, label=name)
    ax.scatter(
        x,
        [r["step_ms"] for r in projections],
        marker="_",
        s=400,
        color="black",
        zorder=3,
        label="step (the sum)",
    )
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=10)
    ax.set_xlabel("KV placement, context (tokens)")
    ax.set_yscale("log")
    ax.set_ylabel("projected time per decode step (ms, log)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


def draw_step_vs_context(ax, rows: list[dict], chosen_context: int, title: str = "") -> None:
    """rows: project_step(...).to_dict() at several contexts, one setting otherwise. Each part of the
    projected step and the step itself against the context (lines, log-log), the chosen context marked."""
    contexts = [r["context"] for r in rows]
    for key, (name, colour) in STEP_PARTS.items():
        ax.plot(contexts, [max(r[key], 1e-4) for r in rows], "o-", color=colour, label=name, markersize=3)
    ax.plot(contexts, [r["step_ms"] for r in rows], "k-", linewidth=2, label="step (the sum)")
    chosen = next(r for r in rows if r["context"] == chosen_context)
    ax.plot([chosen_context], [chosen["step_ms"]], "o", color="black", markersize=9, fillstyle="none")
    ax.axvline(chosen_context, color="black", alpha=0.3, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("projected time (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(alpha=0.3)
