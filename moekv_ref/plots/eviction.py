"""Figures of eviction over a trace: each device's pool over time under a policy, what every
eviction freed on each device, the policies side by side, density per expert buffer, and the
recompute-versus-swap crossover, the policies against the exact optimum; for prefix caching, the
hit map and a summary. Inputs are the objects sim/runner.py (the scheduler over a trace),
sim/density.py and apps/bench_eviction.py return. Legends sit beside the data, not on it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator


def plot_device_pools(stats, blocks_per_device: int, ax=None, legend: bool = True):
    """Blocks in use on each device after every step; the dashed line is one device's pool.
    legend=False leaves the legend to `shared_device_legend` (a figure of several such panels)."""
    ax = ax or plt.gca()
    used = stats.used_blocks.numpy()  # (steps, D)
    for d in range(used.shape[1]):
        ax.plot(used[:, d], label=f"device {d}", lw=1)
    ax.axhline(blocks_per_device, color="k", ls="--", lw=0.8, label="one device's pool")
    ax.set(title=f"{stats.policy}: pool use per device", xlabel="step", ylabel="blocks in use")
    ax.title.set_fontsize(10)
    if legend:
        ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def plot_evictions(stats, ax=None, legend: bool = True):
    """One bar group per eviction (in order): blocks it freed on each device; the short device is
    marked by a dot. legend=False as in plot_device_pools."""
    ax = ax or plt.gca()
    if not stats.evictions:
        ax.text(0.5, 0.5, "no evictions", ha="center", transform=ax.transAxes)
        ax.set(title=f"{stats.policy}: evictions")
        return ax
    freed = np.array([r.freed for r in stats.evictions])  # (n, D)
    bottom = np.zeros(freed.shape[0])
    for d in range(freed.shape[1]):
        ax.bar(np.arange(freed.shape[0]), freed[:, d], bottom=bottom, label=f"device {d}", width=1.0)
        bottom += freed[:, d]
    short = np.array([r.short_device for r in stats.evictions])
    ax.scatter(
        np.arange(freed.shape[0]),
        freed[np.arange(freed.shape[0]), short],
        s=6,
        c="k",
        zorder=3,
        label="on the short device",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # evictions are counted
    kind = {r.mode for r in stats.evictions}
    ax.set(
        title=f"{stats.policy}: what each eviction freed ({', '.join(sorted(kind))})",
        xlabel="eviction",
        ylabel="blocks freed",
    )
    ax.title.set_fontsize(10)
    if legend:
        ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def shared_device_legend(fig, axes) -> None:
    """One legend for a figure's pool and eviction panels, above them, each label once: their
    colours mean the same devices in every panel. The figure must use layout="constrained"."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    fig.legend(
        list(entries.values()),
        list(entries),
        loc="outside upper center",
        fontsize=10,
        ncol=min(len(entries), 6),
        frameon=False,
    )


def plot_policy_comparison(comparison: dict, axes=None):
    """Tokens per step and per (modelled) second, and recomputed tokens, per policy; the bound's
    tokens per step as a line."""
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    names = list(comparison["stats"])
    stats = [comparison["stats"][n] for n in names]
    bound = comparison["bound"]["tokens_per_step"]
    axes[0].bar(names, [s.tokens_per_step for s in stats], color="#4c9be8")
    axes[0].axhline(bound, color="k", ls="--", lw=0.8)
    axes[0].text(-0.4, bound, "memory-time bound", fontsize=10, va="bottom")  # above the line, off the bars
    axes[0].set_ylim(0, 1.15 * bound)
    axes[0].set(title="finished tokens per step", ylabel="finished tokens / step")
    axes[1].bar(names, [s.tokens_per_second for s in stats], color="#5bb974")
    axes[1].set(title="finished tokens per modelled second", ylabel="finished tokens / s")
    axes[2].bar(names, [s.recomputed_tokens for s in stats], color="#e8a33d")
    axes[2].set(title="recomputed tokens", ylabel="tokens")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30, labelsize=10)
        for label in ax.get_xticklabels():  # right-aligned to its bar, so neighbours do not overlap
            label.set(horizontalalignment="right", rotation_mode="anchor")
        ax.title.set_fontsize(10)
    return axes


def plot_optimum_comparison(rows: list[dict], ax=None):
    """Per policy and instance (bench_eviction.compare_with_optimum's rows, or the JSON's): how many
    more steps than the exact optimum over victim choices it took, in percent (0: it found an
    optimal schedule). The legend gives each instance's optimum and worst schedule, in steps."""
    ax = ax or plt.gca()
    names = list(rows[0]["policies"])
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        best, worst = row["optimum"]["steps"], row["optimum"]["worst_steps"]
        extra = [100 * (row["policies"][name]["steps"] / best - 1) for name in names]
        x = np.arange(len(names)) + (i - (len(rows) - 1) / 2) * width
        ax.bar(
            x,
            extra,
            width,
            label=f"{row['num_sequences']} seqs, out {row['mean_output']}, seed {row['seed']}: "
            f"optimum {best}, worst {worst}",
        )
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names, fontsize=10)
    ax.set(title="steps above the exact optimum over victim choices", ylabel="% more steps than the optimum")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def plot_density(density, placement=None, ax=None):
    """Heat map of density[l, e] (fraction of sequences each buffer holds); with a placement (L, E),
    each cell is labelled with its expert's device."""
    ax = ax or plt.gca()
    image = ax.imshow(np.asarray(density), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    if placement is not None:
        for (layer, e), d in np.ndenumerate(np.asarray(placement)):
            ax.text(e, layer, str(d), ha="center", va="center", fontsize=10, color="w")
    ax.set(title="density: fraction of sequences each buffer holds", xlabel="expert", ylabel="layer")
    plt.colorbar(image, ax=ax)
    return ax


def plot_crossover(projected: dict, ax=None):
    """Recompute against swap seconds by context, one swap line per (link, block size)."""
    ax = ax or plt.gca()
    first = next(iter(projected.values()))
    ax.plot(first["contexts"], np.array(first["recompute_seconds"]) * 1e3, "k", lw=2, label="recompute")
    for key, value in projected.items():
        crossover = value["crossover_context"]
        since = f"cheaper from {crossover}" if crossover is not None else "never cheaper here"
        ax.plot(value["contexts"], np.array(value["swap_seconds"]) * 1e3, lw=1, label=f"swap {key} ({since})")
    ax.set(title="recompute vs swap (projected)", xlabel="context (tokens)", ylabel="ms")
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def prefix_hit_grid(request, num_layers: int, num_experts: int, block_size: int) -> np.ndarray:
    """(L * E, blocks) status of each block of a finished request's rows: 0 none, 1 computed by the
    request, 2 copied from the cache (copy-on-write of a block straddling s), 3 shared from the cache.
    Rows are layer * E + expert; needs request.final_token_counts (engine with record_history) and
    request.prefix_hit (None: nothing came from the cache)."""
    counts = request.final_token_counts.reshape(-1).numpy()  # (L*E,)
    num_blocks = -(-counts // block_size)  # (L*E,)
    grid = np.zeros((num_layers * num_experts, max(1, int(num_blocks.max()))), dtype=np.int64)
    grid[np.arange(grid.shape[1])[None, :] < num_blocks[:, None]] = 1
    hit = request.prefix_hit
    if hit is not None:
        grid[hit.shared_rows.numpy(), hit.shared_columns.numpy()] = 3
        cow_rows = hit.cow_rows.numpy()
        grid[cow_rows, hit.row_counts.numpy()[cow_rows] // block_size] = 2
    return grid


def plot_prefix_hit_map(requests, num_layers: int, num_experts: int, block_size: int, axes=None):
    """One panel per request: its (layer, expert) rows (y) and their blocks (x), coloured by where each
    block came from -- shared from the prefix cache, copied (copy-on-write), or computed by the
    request. The first request of a workload finds nothing; later ones share most of the prefix."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colours = ["white", "0.75", "tab:orange", "tab:green"]
    if axes is None:
        _, axes = plt.subplots(1, len(requests), figsize=(3.2 * len(requests), 4), squeeze=False)
        axes = axes[0]
    grids = [prefix_hit_grid(r, num_layers, num_experts, block_size) for r in requests]
    width = max(g.shape[1] for g in grids)
    for ax, request, grid in zip(axes, requests, grids):
        padded = np.zeros((grid.shape[0], width), dtype=np.int64)
        padded[:, : grid.shape[1]] = grid
        ax.imshow(
            padded, cmap=ListedColormap(colours), vmin=0, vmax=3, aspect="auto", interpolation="nearest"
        )
        skipped = 0 if request.prefix_hit is None else request.prefix_hit.num_tokens
        ax.set(
            title=f"request {request.request_id}:\n{skipped} of {len(request.prompt_token_ids)} prompt tokens cached",
            xlabel="block of the row",
        )
        ax.title.set_fontsize(10)
        ax.set_yticks(np.arange(0, grid.shape[0], num_experts))
        ax.set_yticklabels([f"layer {layer}" for layer in range(num_layers)], fontsize=10)
        ax.set_yticks(np.arange(grid.shape[0]), minor=True)
        ax.set_xticks(np.arange(width))
        for layer in range(1, num_layers):  # layer boundaries
            ax.axhline(layer * num_experts - 0.5, color="k", lw=0.6)
    axes[0].set_ylabel("(layer, expert) row")
    axes[0].figure.legend(
        handles=[
            Patch(color=c, label=label)
            for c, label in zip(colours[1:], ["computed", "copied (copy-on-write)", "shared"])
        ],
        fontsize=10,
        ncol=3,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
    )  # below, off the data
    return axes


def plot_prefix_cache_summary(results: dict, ax=None):
    """Steps and tokens computed without and with the prefix cache (compare_prefix_caching's dict)."""
    ax = ax or plt.gca()
    names = ["steps", "tokens computed / 100"]
    off = [results["off"]["num_steps"], results["off"]["num_computed_tokens"] / 100]
    on = [results["on"]["num_steps"], results["on"]["num_computed_tokens"] / 100]
    x = np.arange(len(names))
    ax.bar(x - 0.2, off, 0.4, label="without prefix cache", color="0.6")
    ax.bar(x + 0.2, on, 0.4, label="with prefix cache", color="tab:green")
    ax.set_xticks(x)
    ax.set_xticklabels(names)
    ax.set(
        title=f"hit rate {results['token_hit_rate']:.2f} of prompt tokens",
        ylabel="steps, or tokens computed / 100",
    )
    ax.set_ylim(0, 1.4 * max(off + on))  # room above the bars for the legend
    ax.legend(fontsize=10, loc="upper right")
    return ax
