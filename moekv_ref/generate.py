"""Batch generation with a chosen cache: prefill a batch of prompts of different lengths, then decode
token by token.

    cache "none"        recompute: every step runs the whole (padded) batch through `model.forward`
    cache "contiguous"  one growing buffer per (sequence, layer, expert)
    cache "paged"       one block pool for every (sequence, layer, expert) (moekv_ref.cache.paged)

This is static batching: the batch is fixed up front and runs until its longest request ends. The
continuous-batching engine (moekv_ref.engine, `generate_with_engine`) serves the same prompts with
the same tokens, as its tests show; `python -m moekv_ref generate --cache paged` runs that one.

`generate(..., record_logits=True)` keeps the logits of every position the model processed, which is
what the equivalence tests compare against a single full forward of the final sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .cache import ContiguousKVCache, PagedKVCache
from .cache.block_pool import a_type
from .model import MoEKVTransformer
from .prompts import check_prompt
from .results import GenerationResult
from .sampling import SamplingParams, sample_next, sample_rows

CACHE_KINDS = ["none", "contiguous", "paged"]


def make_cache(kind: str, model: MoEKVTransformer, **options):
    """A fresh, empty cache of the given kind for `model`."""
    config = model.config
    if kind == "contiguous":
        return ContiguousKVCache(config.num_hidden_layers, config.num_attention_experts)
    if kind == "paged":
        return PagedKVCache.for_model(model, **options)
    raise ValueError(f"unknown cache kind {kind!r}; allowed: {CACHE_KINDS}")


def check_prompts(model: MoEKVTransformer, prompts, per_prompt: list[SamplingParams]) -> list[list[int]]:
    """The prompts as lists of ints, or ValueError before any work: no prompts, an empty prompt,
    token ids that are not integers of the vocabulary, or a prompt + its own max_new_tokens past the
    model's positions."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompts given: pass at least one non-empty prompt")
    config = model.config
    return [check_prompt(prompt, config.vocab_size, config.max_position_embeddings, params.max_new_tokens,
                         f"prompt {i}") for i, (prompt, params) in enumerate(zip(prompts, per_prompt))]


def check_params(params, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (validated again: a frozen dataclass can be forced)."""
    per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * num_prompts
    if len(per_prompt) != num_prompts:
        raise ValueError(f"got {len(per_prompt)} sampling params for {num_prompts} prompts")
    for i, p in enumerate(per_prompt):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return [SamplingParams(**dataclasses.asdict(p)) for p in per_prompt]


@torch.no_grad()
def generate(
    model: MoEKVTransformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams] = SamplingParams(),
    cache: str = "contiguous",
    record_logits: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    **cache_options,
) -> GenerationResult:
    """Generate `max_new_tokens` for every prompt. `params` may be one per prompt (own seeds), and
    each prompt is checked against its own max_new_tokens. cache_options (block_size, num_blocks,
    ...) apply to cache="paged" only; without num_blocks its pool is sized for every prompt at once."""
    if not isinstance(model, MoEKVTransformer):
        raise ValueError(f"model must be a MoEKVTransformer, got {type(model).__name__}")
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {cache!r}; allowed: {CACHE_KINDS}")
    if cache_options and cache != "paged":
        raise ValueError(f"{sorted(cache_options)} apply to cache='paged' only, not cache={cache!r}")
    if not isinstance(record_logits, bool):
        raise ValueError(f"record_logits={record_logits!r} is {a_type(record_logits)}; allowed: True or False")
    for flag in ("shared_tails", "enable_prefix_caching", "home_devices"):   # PagedKVCache's switches: never truthy text
        if flag in cache_options and not isinstance(cache_options[flag], bool):
            raise ValueError(f"{flag}={cache_options[flag]!r} is {a_type(cache_options[flag])}; "
                             "allowed: True or False")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be callable (or None), got {type(on_token).__name__}")
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (lists of token ids)")
    per_prompt = check_params(params, len(prompts))
    prompts = check_prompts(model, prompts, per_prompt)
    if cache == "paged" and "num_blocks" not in cache_options and "max_num_seqs" not in cache_options:
        cache_options = {**cache_options, "max_num_seqs": len(prompts)}   # a pool for all of them
    if cache != "none":
        kv_cache = make_cache(cache, model, **cache_options)
    generators = [p.generator() for p in per_prompt]
    generated: list[list[int]] = [[] for _ in prompts]
    logits_log: list[list[torch.Tensor]] = [[] for _ in prompts]
    if cache == "none":
        counts = _generate_recompute(model, prompts, per_prompt, generators, generated, logits_log,
                                     record_logits, on_token)
    else:
        counts = _generate_cached(model, kv_cache, prompts, per_prompt, generators, generated,
                                  logits_log, record_logits, on_token)
    logits = [torch.cat(chunks) for chunks in logits_log] if record_logits else None
    return GenerationResult(prompts, generated, counts, logits, {"cache": cache, **cache_options})


def _sample_step(step_logits, active, per_prompt, generators, generated, on_token):
    for i in active:
        token = sample_next(step_logits[i], per_prompt[i], generators[i])
        _emit(i, token, generated, on_token)


def _emit(i, token, generated, on_token):
    generated[i].append(token)
    if on_token is not None:
        on_token(i, token)


def _generate_cached(model, kv_cache, prompts, per_prompt, generators, generated, logits_log,
                     record_logits, on_token):
    device = next(model.parameters()).device
    B = len(prompts)
    # prefill: all prompts as one flat ragged batch
    lengths = [len(p) for p in prompts]
    tokens = torch.tensor([t for p in prompts for t in p], device=device)               # (N,)
    seq_ids = torch.repeat_interleave(torch.arange(B, device=device), torch.tensor(lengths, device=device))
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])            # (N,)
    logits = model.forward_cached(tokens, seq_ids, positions, kv_cache).logits          # (N, V)
    ends = torch.tensor(lengths, device=device).cumsum(0) - 1
    if record_logits:
        for i, chunk in enumerate(torch.split(logits, lengths)):
            logits_log[i].append(chunk.float() if chunk.dtype == torch.bfloat16 else chunk)
    _sample_step(logits[ends], range(B), per_prompt, generators, generated, on_token)
    # decode: one token per still-active sequence
    while True:
        active = [i for i in range(B) if len(generated[i]) < per_prompt[i].max_new_tokens]
        if not active:
            break
        tokens = torch.tensor([generated[i][-1] for i in active], device=device)        # (b,)
        seq_ids = torch.tensor(active, device=device)
        positions = torch.tensor([lengths[i] + len(generated[i]) - 1 for i in active], device=device)
        logits = model.forward_cached(tokens, seq_ids, positions, kv_cache).logits      # (b, V)
        if record_logits:
            for row, i in enumerate(active):
                logits_log[i].append(logits[row: row + 1])
        sampled = sample_rows(logits, [per_prompt[i] for i in active], [generators[i] for i in active])
        for i, token in zip(active, sampled):
            _emit(i, token, generated, on_token)
    return kv_cache.token_counts(list(range(B)))


def _generate_recompute(model, prompts, per_prompt, generators, generated, logits_log,
                        record_logits, on_token):
    device = next(model.parameters()).device
    B = len(prompts)
    first = True
    while True:
        active = [i for i in range(B) if len(generated[i]) < per_prompt[i].max_new_tokens]
        if not active:
            break
        sequences = [prompts[i] + generated[i] for i in active]
        width = max(len(s) for s in sequences)
        batch = torch.zeros(len(active), width, dtype=torch.long, device=device)       # right-padded
        for row, s in enumerate(sequences):
            batch[row, : len(s)] = torch.tensor(s)
        output = model(batch)                                                           # (b, T, V)
        step_logits = {}
        for row, i in enumerate(active):
            n = len(sequences[row])
            step_logits[i] = output.logits[row, n - 1]
            if record_logits:
                logits_log[i].append(output.logits[row, :n] if first else output.logits[row, n - 1 : n])
        first = False
        _sample_step(step_logits, active, per_prompt, generators, generated, on_token)
    # what a cache would hold: every processed token (the last sampled one is never fed back)
    config = model.config
    sequences = [prompts[i] + generated[i][:-1] for i in range(B)]
    width = max(len(s) for s in sequences)
    batch = torch.zeros(B, width, dtype=torch.long, device=device)
    valid = torch.zeros(B, width, dtype=torch.bool, device=device)
    for row, s in enumerate(sequences):
        batch[row, : len(s)] = torch.tensor(s)
        valid[row, : len(s)] = True
    routing = model(batch).attention_routing
    counts = torch.stack([(r.selected & valid[..., None]).sum(1) for r in routing], dim=1)  # (B, L, E)
    assert counts.shape == (B, config.num_hidden_layers, config.num_attention_experts)
    return counts.cpu()
