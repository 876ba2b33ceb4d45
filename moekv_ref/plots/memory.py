"""Drawings of memory designs, for notebook 03 and figures/: the first-fit address space with its
holes, the block pool coloured by owner, and the sweeps of bench memory. Matplotlib only; every
function draws on an Axes it is given and computes nothing the package does not test."""

from __future__ import annotations

import numpy as np
import torch

from ..sim.contiguous_designs import FirstFitDesign
from ..sim.designs import ManagerPagedDesign

HOLE_STYLE = {"facecolor": "white", "edgecolor": "#555555", "hatch": "////", "linewidth": 0.4}
OWNER_LABELS = {"seq": "sequence", "layer": "layer", "expert": "expert"}


# tab10 without its grey (index 7), which would read as "unused" or "free": 9 owner colours, cycled
OWNER_PALETTE = np.array(
    [
        (0.122, 0.467, 0.706),
        (1.0, 0.498, 0.055),
        (0.173, 0.627, 0.173),
        (0.839, 0.153, 0.157),
        (0.580, 0.404, 0.741),
        (0.549, 0.337, 0.294),
        (0.890, 0.467, 0.761),
        (0.737, 0.741, 0.133),
        (0.090, 0.745, 0.812),
    ]
)


def _colours(values) -> np.ndarray:
    """RGBA per owner value (an integer), from OWNER_PALETTE."""
    rgb = OWNER_PALETTE[np.asarray(values, dtype=np.int64) % len(OWNER_PALETTE)]
    return np.concatenate([rgb, np.ones(rgb.shape[:-1] + (1,))], axis=-1)


def _owner_legend(ax, values: np.ndarray, colour_by: str, extra: list) -> None:
    """A colour legend outside the axes, at its right: one entry per owner value drawn, then `extra`."""
    from matplotlib.patches import Patch

    present = sorted({int(v) for v in np.asarray(values)})
    handles = [
        Patch(color=_colours([v])[0], label=f"{OWNER_LABELS[colour_by]} {v}")
        for v in present[: len(OWNER_PALETTE)]
    ]
    ax.legend(
        handles=handles + extra,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=10,
        frameon=False,
        title=f"colour = {OWNER_LABELS[colour_by]}",
        title_fontsize=10,
    )


def draw_first_fit_map(
    ax,
    design: FirstFitDesign,
    colour_by: str = "expert",
    width: int = 256,
    title: str | None = None,
    legend: bool = True,
) -> None:
    """The address space as lines of `width` slots: buffers coloured by `colour_by` (seq, layer or
    expert), their unused ends pale, holes white and hatched grey (never a buffer colour)."""
    from matplotlib.patches import Patch

    memory = design.memory_map()
    top = max(1, memory["top"])
    height = -(-top // width)

    def spans(start, size):
        """Split [start, start+size) at the line boundaries of the drawing: (x, y, length) pieces."""
        while size > 0:
            x, y = start % width, start // width
            length = min(size, width - x)
            yield x, y, length
            start, size = start + length, size - length

    colours = _colours(memory[colour_by])
    for start, size, used, colour in zip(memory["start"], memory["size"], memory["used"], colours):
        for x, y, length in spans(int(start), int(used)):
            ax.broken_barh([(x, length)], (y, 0.9), facecolors=colour)
        for x, y, length in spans(int(start + used), int(size - used)):
            ax.broken_barh([(x, length)], (y, 0.9), facecolors=colour, alpha=0.25)
    for start, size in zip(memory["hole_start"], memory["hole_size"]):
        for x, y, length in spans(int(start), int(size)):
            ax.broken_barh([(x, length)], (y, 0.9), **HOLE_STYLE)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_xlabel("slot within the line (one slot = one token's K and V)")
    ax.set_ylabel(f"address // {width} (lines of {width} slots)")
    ax.set_title(
        title or f"first_fit address space: {memory['top']} slots up to the top of the heap", fontsize=11
    )
    if legend:
        _owner_legend(
            ax,
            memory[colour_by],
            colour_by,
            [
                # drawn as the ends are: a buffer's own colour, pale (here the first buffer's)
                Patch(
                    facecolor=colours[0] if len(colours) else "grey",
                    alpha=0.25,
                    label="unused end of a buffer",
                ),
                Patch(label="hole: free, too small to reuse", **HOLE_STYLE),
            ],
        )


def block_owners(manager) -> tuple[torch.Tensor, torch.Tensor]:
    """For drawing a manager's pool: owner_row (N,) (-1: free) and used_slots (N,) of each block."""
    P = manager.block_size
    row, column = manager.used_columns().nonzero(as_tuple=True)
    blocks = manager.block_tables[row, column].to(torch.int64)
    owner_row = torch.full((manager.num_blocks,), -1, dtype=torch.int64)
    used_slots = torch.zeros(manager.num_blocks, dtype=torch.int64)
    owner_row[blocks] = row
    used_slots[blocks] = (manager.row_tokens[row] - column * P).clamp(max=P)
    return owner_row, used_slots


def draw_pool(
    ax,
    design: ManagerPagedDesign,
    colour_by: str = "expert",
    width: int = 32,
    title: str | None = None,
    legend: bool = True,
) -> None:
    """The block pool as a grid of blocks, `width` per line: coloured by the owner's `colour_by`
    (seq, layer or expert), paler the emptier the block, free blocks white."""
    from matplotlib.patches import Patch

    manager = design.manager
    owner_row, used_slots = (t.numpy() for t in block_owners(manager))
    seq, layer, expert = manager.index.split(owner_row)  # -1 rows are masked below
    owners = {"seq": seq, "layer": layer, "expert": expert}[colour_by]
    num_blocks = manager.num_blocks
    height = -(-num_blocks // width)
    image = np.ones((height * width, 4))
    taken = owner_row >= 0
    image[:num_blocks][taken] = _colours(owners[taken])
    image[:num_blocks][taken, 3] = 0.25 + 0.75 * used_slots[taken] / manager.block_size
    image[num_blocks:] = (0.85, 0.85, 0.85, 1.0)  # past the pool's end
    ax.imshow(image.reshape(height, width, 4), interpolation="nearest", aspect="auto")
    ax.set_xlabel(f"block id % {width}")
    ax.set_ylabel(f"block id // {width}")
    ax.set_title(
        title
        or f"paged pool: {int(taken.sum())} of {num_blocks} blocks of {manager.block_size} slots in use",
        fontsize=11,
    )
    if legend:
        _owner_legend(
            ax,
            owners[taken],
            colour_by,
            [
                Patch(facecolor="grey", alpha=0.4, label="paler: block partly filled"),
                Patch(facecolor="white", edgecolor="grey", label="free block"),
            ],
        )


METRIC_LABELS = {
    "effective_utilization": "effective utilization\n(live KV / allocated incl. metadata)",
    "utilization": "utilization (live KV / allocated KV)",
    "reads_per_decode_token": "contiguous reads per decode token\n(summed over layers)",
}


def _finish_sweep(ax, key: str, title: str | None) -> None:
    ax.set_ylabel(METRIC_LABELS.get(key, key.replace("_", " ")))
    if "utilization" in key:
        ax.axhline(0.96, color="grey", linestyle=":", linewidth=1, label="0.96 target")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=10, loc="lower left")
    else:
        ax.legend(fontsize=10, loc="best")
    if title:
        ax.set_title(title, fontsize=11)


def plot_block_size_sweep(
    ax, rows: list[dict], key: str = "effective_utilization", title: str | None = None
) -> None:
    _plot_sweep(ax, rows, "block_size", key, "block size P (slots per block)", title)


def plot_num_experts_sweep(
    ax, rows: list[dict], key: str = "effective_utilization", title: str | None = None
) -> None:
    _plot_sweep(
        ax, rows, "num_experts", key, f"attention experts per layer E (top-{rows[0]['top_k']})", title
    )


def _plot_sweep(ax, rows: list[dict], x: str, key: str, xlabel: str, title: str | None) -> None:
    """One line per design: `key` against the powers of two in column `x`."""
    for design in sorted({r["design"] for r in rows}):
        points = [(r[x], r[key]) for r in rows if r["design"] == design]
        ax.plot(*zip(*points), "o-", label=design)
    ax.set_xscale("log", base=2)
    values = sorted({r[x] for r in rows})
    ax.set_xticks(values, [str(v) for v in values])
    ax.set_xlabel(xlabel)
    _finish_sweep(ax, key, title)
