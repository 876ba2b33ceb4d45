"""Sampling parameters and the choice of the next token.

Every sequence samples with its own `torch.Generator`, seeded from its own seed, so what it
generates never depends on which other sequences share its batch (a property the serving engine's
tests rely on: preempted-and-resumed = never preempted = generated alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1] keeps the smallest set of tokens whose
    probability reaches top_p (nucleus sampling, Holtzman et al., arXiv 1904.09751)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits (V,)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        sorted_probs[mass_before >= params.top_p] = 0                # drop what lies past top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
