"""Figures the notebooks and `figures/` share. Each takes data from package functions and a matplotlib
axis, so a notebook cell or widget callback stays one line. Sized to be read at notebook width (about
9 inches at 100 dpi): titles, axis labels with units, legends outside the data."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ..prompts import encode

ROUTED_COLOUR = "#2b6cb0"


def show_char(byte: int) -> str:
    char = chr(byte) if 32 <= byte < 127 else {10: "\\n", 9: "\\t", 32: "␣"}.get(byte, "·")
    return "␣" if char == " " else char


def plot_routing(selected, text: str, layer: int, ax=None):
    """One layer's routing: tokens along x, experts along y, a filled cell where the token's K/V go
    into that expert's cache; the count each expert's cache holds is written at the right."""
    ax = ax or plt.gca()
    matrix = selected[layer].T.numpy().astype(float)  # (E, T)
    num_experts, num_tokens = matrix.shape
    ax.imshow(
        matrix,
        aspect="auto",
        cmap=plt.matplotlib.colors.ListedColormap(["#f4f4f4", ROUTED_COLOUR]),
        vmin=0,
        vmax=1,
        interpolation="nearest",
    )
    tokens = encode(text)
    step = -(-num_tokens // 40)  # at most 40 labels: a longer prompt labels every step-th token
    ax.set_xticks(range(0, num_tokens, step), [show_char(t) for t in tokens[::step]], fontsize=10)
    ax.set_yticks(range(num_experts), [f"e{e}" for e in range(num_experts)], fontsize=10)
    ax.set_xticks(np.arange(-0.5, num_tokens), minor=True)
    ax.set_yticks(np.arange(-0.5, num_experts), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    counts = matrix.sum(1).astype(int)
    for e, c in enumerate(counts):
        ax.text(num_tokens - 0.3, e, f" {c}", va="center", fontsize=10)
    ax.text(num_tokens - 0.3, -0.7, " held", va="bottom", fontsize=10)
    ax.set_xlabel("prompt, one byte-token per column (␣ = space)")
    ax.set_ylabel("attention expert")
    ax.set_title(f"layer {layer}: which experts' caches each token's K/V go into", fontsize=11)
    ax.legend(
        handles=[
            Patch(color=ROUTED_COLOUR, label="routed: K/V stored in this expert's cache"),
            Patch(facecolor="#f4f4f4", edgecolor="grey", label="not routed"),
        ],
        loc="upper left",
        bbox_to_anchor=(0, -0.28),
        ncol=2,
        fontsize=10,
        frameon=False,
    )
    return ax


def plot_cache_sizes(counts, ax=None, title="tokens each expert's cache holds, per layer"):
    """Grouped bars: for each layer, the tokens each expert's cache holds. counts: (L, E)."""
    ax = ax or plt.gca()
    counts = np.asarray(counts)
    num_layers, num_experts = counts.shape
    width = 0.8 / num_layers
    for layer in range(num_layers):
        ax.bar(np.arange(num_experts) + layer * width, counts[layer], width, label=f"layer {layer}")
    ax.axhline(counts.sum() / counts.size, color="k", lw=0.8, ls="--", label="uniform split")
    ax.set_xticks(np.arange(num_experts) + 0.4 - width / 2, [f"e{e}" for e in range(num_experts)])
    ax.set_xlabel("attention expert")
    ax.set_ylabel("tokens held (cache entries)")
    ax.set_title(title, fontsize=11)
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return ax
