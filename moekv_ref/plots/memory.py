"""Drawings of memory designs, for notebook 03 and figures/: the first-fit address space with its
holes, the block pool coloured by owner, and the sweeps of bench memory. Matplotlib only; every
function draws on an Axes it is given and computes nothing the package does not test."""

from __future__ import annotations

import numpy as np

from ..sim.baselines import FirstFitDesign
from ..sim.designs import ManagerPagedDesign


def _colours(values: np.ndarray, num: int, cmap: str = "tab10"):
    import matplotlib.pyplot as plt
    return plt.get_cmap(cmap)(np.asarray(values) % 10 / 9)


def draw_first_fit_map(ax, design: FirstFitDesign, colour_by: str = "expert", width: int = 256) -> None:
    """The address space as rows of `width` slots: buffers coloured by `colour_by` (seq, layer or
    expert), their unused ends hatched light, holes white with a red outline."""
    memory = design.memory_map()
    top = max(1, memory["top"])
    height = -(-top // width)

    def spans(start, size):
        """Split [start, start+size) at the row boundaries of the drawing: (x, y, length) pieces."""
        while size > 0:
            x, y = start % width, start // width
            length = min(size, width - x)
            yield x, y, length
            start, size = start + length, size - length

    colours = _colours(memory[colour_by], int(memory[colour_by].max(initial=0)) + 1)
    for start, size, used, colour in zip(memory["start"], memory["size"], memory["used"], colours):
        for x, y, length in spans(int(start), int(used)):
            ax.broken_barh([(x, length)], (y, 0.9), facecolors=colour)
        for x, y, length in spans(int(start + used), int(size - used)):
            ax.broken_barh([(x, length)], (y, 0.9), facecolors=colour, alpha=0.25)
    for start, size in zip(memory["hole_start"], memory["hole_size"]):
        for x, y, length in spans(int(start), int(size)):
            ax.broken_barh([(x, length)], (y, 0.9), facecolors="white", edgecolors="red", linewidth=0.6)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_xlabel("slot within line")
    ax.set_ylabel(f"line of {width} slots")


def draw_pool(ax, design: ManagerPagedDesign, colour_by: str = "expert", width: int = 32) -> None:
    """The block pool as a grid of blocks, `width` per line: coloured by the owner's `colour_by`
    (seq, layer or expert), brightness by how full the block is, free blocks white."""
    manager = design.manager
    owner_row, used_slots = (t.numpy() for t in manager.block_owners())
    seq, layer, expert = manager.index.split(owner_row)                     # -1 rows are masked below
    owners = {"seq": seq, "layer": layer, "expert": expert}[colour_by]
    num_blocks = manager.num_blocks
    height = -(-num_blocks // width)
    image = np.ones((height * width, 4))
    taken = owner_row >= 0
    image[:num_blocks][taken] = _colours(owners[taken], int(owners[taken].max(initial=0)) + 1)
    image[:num_blocks][taken, 3] = 0.25 + 0.75 * used_slots[taken] / manager.block_size
    ax.imshow(image.reshape(height, width, 4), interpolation="nearest", aspect="auto")
    ax.set_xlabel("block id % width")
    ax.set_ylabel("block id // width")


def plot_block_size_sweep(ax, rows: list[dict], key: str = "effective_utilization") -> None:
    for design in sorted({r["design"] for r in rows}):
        points = [(r["block_size"], r[key]) for r in rows if r["design"] == design]
        ax.plot(*zip(*points), "o-", label=design)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size P (slots)")
    ax.set_ylabel(key.replace("_", " "))
    if "utilization" in key:
        ax.axhline(0.96, color="grey", linestyle=":", linewidth=1)
    ax.legend()


def plot_num_experts_sweep(ax, rows: list[dict], key: str = "effective_utilization") -> None:
    for design in sorted({r["design"] for r in rows}):
        points = [(r["num_experts"], r[key]) for r in rows if r["design"] == design]
        ax.plot(*zip(*points), "o-", label=design)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"attention experts E (top-{rows[0]['top_k']})")
    ax.set_ylabel(key.replace("_", " "))
    if "utilization" in key:
        ax.axhline(0.96, color="grey", linestyle=":", linewidth=1)
    ax.legend()
