"""Figures the notebooks and `figures/` share. Each takes data from package functions and a matplotlib
axis, so a notebook cell or widget callback stays one line."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..tokenizer import encode


def show_char(byte: int) -> str:
    char = chr(byte) if 32 <= byte < 127 else {10: "\\n", 9: "\\t", 32: "␣"}.get(byte, "·")
    return "␣" if char == " " else char


def plot_routing(selected, text: str, layer: int, ax=None):
    """Heat map of one layer's routing: tokens along x, experts along y, filled where routed."""
    ax = ax or plt.gca()
    matrix = selected[layer].T.numpy().astype(float)                       # (E, T)
    ax.imshow(matrix, aspect="auto", cmap="Blues", vmin=0, vmax=1.3, interpolation="nearest")
    tokens = encode(text)
    ax.set_xticks(range(len(tokens)), [show_char(t) for t in tokens], fontsize=8)
    ax.set_yticks(range(matrix.shape[0]), [f"e{e}" for e in range(matrix.shape[0])])
    counts = matrix.sum(1).astype(int)
    for e, c in enumerate(counts):
        ax.text(len(tokens) - 0.4, e, f" {c}", va="center", fontsize=8)
    ax.set_title(f"layer {layer}: experts per token (cache entries per expert at right)")
    return ax


def plot_cache_sizes(counts, ax=None, title="tokens held per (layer, expert)"):
    """Grouped bars: for each layer, the tokens each expert's cache holds. counts: (L, E)."""
    ax = ax or plt.gca()
    counts = np.asarray(counts)
    num_layers, num_experts = counts.shape
    width = 0.8 / num_layers
    for layer in range(num_layers):
        ax.bar(np.arange(num_experts) + layer * width, counts[layer], width, label=f"layer {layer}")
    ax.axhline(counts.sum() / counts.size, color="k", lw=0.8, ls="--", label="uniform split")
    ax.set_xticks(np.arange(num_experts) + 0.4 - width / 2, [f"e{e}" for e in range(num_experts)])
    ax.set_ylabel("tokens")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    return ax
