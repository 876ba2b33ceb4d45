"""Prompts: text as token ids, and what `generate` and the serving engine accept as token ids.

Bytes are tokens: vocabulary 256, nothing to download, any text round-trips (`encode`, `decode`).

`check_prompt` takes ints, integer scalars such as numpy's, or a 1-D integer tensor. Floats are
refused even when whole (3.0): a float where a token id belongs is a bug upstream, and truncating
it would hide it.
"""

from __future__ import annotations

import operator

import torch


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def check_prompt(prompt, vocab_size: int, max_positions: int, max_new_tokens: int,
                 name: str = "the prompt") -> list[int]:
    """The prompt as a list of ints, or ValueError naming the first thing wrong with it."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"{name} is text ({type(prompt).__name__}), not token ids: encode it first "
                         "(moekv_ref.prompts.encode)")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor of token ids, got {prompt.dtype} of shape "
                             f"{tuple(prompt.shape)}")
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
            raise ValueError(f"{name}: token {position} is {token!r}, not a token id (an integer in [0, {vocab_size}))")
        try:
            value = operator.index(token)
        except TypeError:
            raise ValueError(f"{name}: token {position} is {token!r} ({type(token).__name__}), not an integer "
                             f"token id in [0, {vocab_size})") from None
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name}: token {position} is {value}, outside the vocabulary [0, {vocab_size})")
        checked.append(value)
    if len(checked) > max_positions:
        raise ValueError(f"{name} has {len(checked)} tokens, more than the model's "
                         f"max_position_embeddings={max_positions}")
    if len(checked) + max_new_tokens - 1 > max_positions:
        raise ValueError(f"{name} ({len(checked)} tokens) + max_new_tokens={max_new_tokens} would pass "
                         f"max_position_embeddings={max_positions}; ask for at most "
                         f"{max_positions - len(checked) + 1} new tokens")
    return checked
