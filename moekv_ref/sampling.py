"""Sampling parameters and the choice of the next token.

Every sequence samples with its own `torch.Generator`, seeded from its own seed, so what it
generates never depends on its batch (the engine's tests rely on it: preempted-and-resumed = never
preempted = generated alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .profiling import phase

# Temperatures between 0 and this are refused: logits / T overflows float64 (to inf, then NaN in the
# softmax) once T is below about 1e-300, and long before that the distribution is argmax anyway.
MIN_TEMPERATURE = 1e-4
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes up to 2**64 - 1; the engine's bound


class SamplingError(RuntimeError):
    """One request's next token could not be sampled; the engine fails that request only."""


def _is_number(value, types=(int, float)) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1] keeps the smallest set of tokens whose
    probability reaches top_p (nucleus sampling, Holtzman et al., arXiv 1904.09751)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not _is_number(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:  # NaN too
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy) and finite")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature!r} is too small to sample with: use 0 (greedy) "
                f"or at least {MIN_TEMPERATURE}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not _is_number(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**63 - 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def _sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise SamplingError(
            f"{bad} of {logits.numel()} logits are not finite (NaN or inf): no token can be sampled"
        )
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        sorted_probs[mass_before >= params.top_p] = 0  # drop what lies past top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    errors: dict | None = None,
) -> list[int | None]:
    """One token for each row of logits (b, V), with row i's params and generator. The greedy rows
    take one finiteness check and one argmax for all of them (not four small tensor ops per row);
    the others sample one by one. A row that cannot be sampled (SamplingError: logits not all
    finite) raises; with `errors`, it gets None and its exception in errors[i] instead, so that the
    engine fails that request alone."""
    with phase("sampling"):
        greedy = [i for i, p in enumerate(params) if p.greedy]
        argmax = {}
        if greedy:
            rows = logits if len(greedy) == len(params) else logits[greedy]  # (g, V)
            if math.isfinite(rows.sum()):  # all finite (one op); else each row is checked alone
                argmax = dict(zip(greedy, rows.argmax(-1).tolist()))
        tokens = []
        for i, p in enumerate(params):
            try:
                tokens.append(argmax[i] if i in argmax else _sample_next(logits[i], p, generators[i]))
            except Exception as error:  # the request's own failure
                if errors is None:
                    raise
                errors[i] = error
                tokens.append(None)
        return tokens
