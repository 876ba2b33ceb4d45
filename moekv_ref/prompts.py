"""Prompts: text as token ids, and what `generate` and the serving engine accept as prompts and
sampling parameters (`check_batch`: one check for both).

Bytes are tokens: vocabulary 256, nothing to download, any text round-trips (`encode`, `decode`).

`check_prompt` takes ints, integer scalars such as numpy's, or a 1-D integer tensor. Floats are
refused even when whole (3.0): a float where a token id belongs is a bug upstream, and truncating
it would hide it.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from .sampling import SamplingParams


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def check_prompt(
    prompt, vocab_size: int, max_positions: int, max_new_tokens: int, name: str = "the prompt"
) -> list[int]:
    """The prompt as a list of ints, or ValueError naming the first thing wrong with it."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(
            f"{name} is text ({type(prompt).__name__}), not token ids: encode it first "
            "(moekv_ref.prompts.encode)"
        )
    if isinstance(prompt, torch.Tensor):
        if (
            prompt.dim() != 1
            or prompt.dtype.is_floating_point
            or prompt.dtype.is_complex
            or prompt.dtype == torch.bool
        ):
            raise ValueError(
                f"{name} must be a 1-D integer tensor of token ids, got {prompt.dtype} of shape "
                f"{tuple(prompt.shape)}"
            )
        prompt = prompt.tolist()
    try:
        tokens = list(prompt)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of token ids, got {type(prompt).__name__}") from None
    if not tokens:
        raise ValueError(f"{name} is empty: a prompt needs at least one token")
    checked = []
    for position, token in enumerate(tokens):
        if isinstance(token, bool):
            raise ValueError(
                f"{name}: token {position} is {token!r}, not a token id (an integer in [0, {vocab_size}))"
            )
        try:
            value = operator.index(token)
        except TypeError:
            raise ValueError(
                f"{name}: token {position} is {token!r} ({type(token).__name__}), not an integer "
                f"token id in [0, {vocab_size})"
            ) from None
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name}: token {position} is {value}, outside the vocabulary [0, {vocab_size})")
        checked.append(value)
    if len(checked) > max_positions:
        raise ValueError(
            f"{name} has {len(checked)} tokens, more than the model's max_position_embeddings={max_positions}"
        )
    if len(checked) + max_new_tokens - 1 > max_positions:
        raise ValueError(
            f"{name} ({len(checked)} tokens) + max_new_tokens={max_new_tokens} would pass "
            f"max_position_embeddings={max_positions}; ask for at most "
            f"{max_positions - len(checked) + 1} new tokens"
        )
    return checked


def check_sampling_params(sampling_params, name: str = "sampling_params") -> SamplingParams:
    """A SamplingParams, a dict of its fields, or None (the defaults), as a validated SamplingParams."""
    if sampling_params is None:
        return SamplingParams()
    if isinstance(sampling_params, dict):
        allowed = [f.name for f in dataclasses.fields(SamplingParams)]
        unknown = sorted(map(str, set(sampling_params) - set(allowed)))
        if unknown:
            raise ValueError(f"{name}: unknown keys {unknown}; allowed keys: {allowed}")
        return SamplingParams(**sampling_params)  # validates
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"{name} must be a SamplingParams or a dict, got {type(sampling_params).__name__}")
    # validate again: a frozen dataclass can still be forced into a bad state
    return SamplingParams(**dataclasses.asdict(sampling_params))


def check_batch(prompts, sampling_params, config, params_name: str) -> list[tuple]:
    """(prompt, params) pairs, each checked; sampling_params: one for all, or a list of one each."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("no prompts given: pass a non-empty list of prompts")
    per_prompt = (
        list(sampling_params)
        if isinstance(sampling_params, (list, tuple))
        else [sampling_params] * len(prompts)
    )
    if len(per_prompt) != len(prompts):
        raise ValueError(f"got {len(per_prompt)} sampling params for {len(prompts)} prompts")
    checked = []
    for i, (prompt, params) in enumerate(zip(prompts, per_prompt)):
        params = check_sampling_params(params, f"{params_name}[{i}]")
        checked.append(
            (
                check_prompt(
                    prompt,
                    config.vocab_size,
                    config.max_position_embeddings,
                    params.max_new_tokens,
                    f"prompt {i}",
                ),
                params,
            )
        )
    return checked
