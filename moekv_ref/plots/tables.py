"""Results as aligned text tables, for notebooks and programs: a printed table keeps its columns at
notebook width where a raw dict wraps mid-key, and needs nothing beyond the standard library."""

from __future__ import annotations

from ..analysis import CHARACTER_CLASSES

CLASS_SHORT = {
    "lowercase": "a-z",
    "uppercase": "A-Z",
    "digit": "0-9",
    "space": "space",
    "newline": "\\n",
    "quote": "quote",
    "bracket": "()[]{}",
    "operator": "op",
    "separator": ".,:;",
    "other": "other",
}
assert set(CLASS_SHORT) == set(CHARACTER_CLASSES)


def _cell(value, fmt: str | None) -> str:
    if fmt is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def text_table(headers: list[str], rows: list[list], formats: list[str | None] | str | None = None) -> str:
    """An aligned table: text columns left-aligned, numbers right-aligned. `formats` is one format
    string for every numeric cell, or one per column (None: str())."""
    if isinstance(formats, str) or formats is None:
        formats = [formats] * len(headers)
    if len(formats) != len(headers) or any(len(row) != len(headers) for row in rows):
        raise ValueError(f"every row and the formats need {len(headers)} columns, one per header {headers}")
    cells = [[_cell(v, f) for v, f in zip(row, formats)] for row in rows]
    # right-align columns of numbers, and of text that starts with one ("17x", "0.93 GB")
    numeric = [
        all(isinstance(row[c], (int, float)) or str(row[c])[:1].isdigit() for row in rows)
        for c in range(len(headers))
    ]
    widths = [max([len(h)] + [len(r[c]) for r in cells]) for c, h in enumerate(headers)]

    def line(values):
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def routing_statistics_table(stats: dict) -> str:
    """Per layer: the router's mean entropy against uniform, the least and most loaded expert's share
    against a uniform 1/E, and experts per token (moekv_ref.analysis.routing_statistics)."""
    rows = [
        [
            layer["layer"],
            layer["router_entropy_bits"],
            layer["uniform_entropy_bits"],
            layer["min_load_over_uniform"],
            layer["max_load_over_uniform"],
            layer["experts_per_token"],
        ]
        for layer in stats["layers"]
    ]
    return text_table(
        [
            "layer",
            "entropy (bits)",
            "uniform (bits)",
            "min load / uniform",
            "max load / uniform",
            "experts/token",
        ],
        rows,
        ["{}", "{:.2f}", "{:.2f}", "{:.2f}", "{:.2f}", "{:.2f}"],
    )


def expert_preferences_table(stats: dict) -> str:
    """Per expert (rows) and layer (columns): the character class the expert is most enriched for and
    by how much, P(class | expert) / P(class)."""
    num_experts = len(stats["layers"][0]["preferences"])
    rows = []
    for expert in range(num_experts):
        row = [f"e{expert}"]
        for layer in stats["layers"]:
            p = layer["preferences"][expert]
            row.append("-" if p["class"] is None else f"{CLASS_SHORT[p['class']]} x{p['enrichment']:.1f}")
        rows.append(row)
    return text_table(["expert"] + [f"layer {layer['layer']}" for layer in stats["layers"]], rows)
