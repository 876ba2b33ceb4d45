"""Result types shared by more than one way of generating, kept below all of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationResult:
    """What `generate.generate` and `engine.generate_with_engine` return for the same prompts."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # generated ids, per prompt
    cache_counts: torch.Tensor  # (B, L, E) tokens a cache holds at the end
    logits: list[torch.Tensor] | None = None  # per prompt: (len(prompt) + generated - 1, V)
    options: dict = field(default_factory=dict)
