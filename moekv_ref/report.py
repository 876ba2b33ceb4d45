"""The per-layer, per-expert cache report: how many tokens and bytes each expert's cache holds, and
how far the split is from uniform."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def cache_report(counts: torch.Tensor, config: ModelConfig, bytes_per_value: int) -> dict:
    """counts: (L, E) or (B, L, E) tokens held per (layer, expert) [per sequence], summed over B.
    Per layer: `max_over_mean` (1.0 = uniform) and `kl_from_uniform_bits` = KL(split || uniform)."""
    if counts.dim() == 3:
        counts = counts.sum(0)
    bytes_per_token = config.kv_bytes_per_entry(bytes_per_value)  # per (layer, expert)
    num_experts = counts.shape[1]
    layers = []
    for layer, row in enumerate(counts.tolist()):
        total = sum(row)
        share = [c / total for c in row] if total else [0.0] * num_experts
        kl = sum(s * math.log2(s * num_experts) for s in share if s > 0)
        layers.append(
            {
                "layer": layer,
                "tokens": row,
                "bytes": [c * bytes_per_token for c in row],
                "total_tokens": total,
                "max_over_mean": (max(row) / (total / num_experts)) if total else 0.0,
                "kl_from_uniform_bits": kl,
            }
        )
    total_tokens = int(counts.sum())
    return {
        "bytes_per_token_per_expert": bytes_per_token,
        "total_tokens": total_tokens,
        "total_bytes": total_tokens * bytes_per_token,
        "layers": layers,
    }


def format_cache_report(report: dict) -> str:
    num_experts = len(report["layers"][0]["tokens"])
    header = (
        "layer | "
        + " ".join(f"{'e' + str(e):>6}" for e in range(num_experts))
        + " |  total   bytes  max/mean  KL(bits)"
    )
    lines = ["KV cache per (layer, expert), tokens held:", header, "-" * len(header)]
    for layer in report["layers"]:
        cells = " ".join(f"{c:>6}" for c in layer["tokens"])
        lines.append(
            f"{layer['layer']:>5} | {cells} | {layer['total_tokens']:>6} {sum(layer['bytes']):>7}"
            f"  {layer['max_over_mean']:8.2f}  {layer['kl_from_uniform_bits']:8.3f}"
        )
    lines.append(
        f"total: {report['total_tokens']} tokens, {report['total_bytes']} bytes "
        f"({report['bytes_per_token_per_expert']} bytes per token per expert)"
    )
    return "\n".join(lines)
