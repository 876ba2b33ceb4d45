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
from .validation import MAX_INT32, check_int, check_real, check_seed, known_keywords, shown

# Temperatures between 0 and this are refused: logits / T overflows float64 (to inf, then NaN in the
# softmax) once T is below about 1e-300, and long before that the distribution is argmax anyway.
MIN_TEMPERATURE = 1e-4


class SamplingError(RuntimeError):
    """One request's next token could not be sampled; the engine fails that request only."""


@known_keywords
@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1] keeps the smallest set of tokens whose
    probability reaches top_p (nucleus sampling, Holtzman et al., arXiv 1904.09751)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        # frozen: the checked values (Python ints and floats) replace what was given
        max_new_tokens = check_int("max_new_tokens", self.max_new_tokens, 1, MAX_INT32)
        object.__setattr__(self, "max_new_tokens", max_new_tokens)
        temperature = check_real("temperature", self.temperature, 0, meaning="0: greedy")
        object.__setattr__(self, "temperature", temperature)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={shown(self.temperature)} is too small to sample with; allowed: 0 (greedy) "
                f"or at least {MIN_TEMPERATURE}"
            )
        object.__setattr__(self, "top_p", check_real("top_p", self.top_p, 0, 1, low_open=True))
        object.__setattr__(self, "seed", check_seed("seed", self.seed))

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
