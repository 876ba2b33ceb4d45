"""Static batching with a chosen cache: prefill a batch of prompts of different lengths, then decode
token by token until the longest request ends (the engine, `generate_with_engine`, gives the same
tokens).

    cache "none"        recompute: every step runs the whole (padded) batch through `model.forward`
    cache "contiguous"  one growing buffer per (sequence, layer, expert)
    cache "paged"       one block pool for every (sequence, layer, expert) (moekv_ref.cache.paged)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from .cache import ContiguousKVCache, PagedKVCache, make_paged_cache
from .engine.demand import min_lifetime_blocks, worst_case_lifetime_blocks_per_device
from .model import MoEKVTransformer
from .prompts import check_batch
from .results import GenerationResult
from .sampling import SamplingParams, sample_rows
from .validation import check_callable, check_choice, check_flag, check_keywords, keywords_of

CACHE_KINDS = ["none", "contiguous", "paged"]
# what cache_options may name (model left out): the paged cache's options and its budget
PAGED_OPTIONS = keywords_of(make_paged_cache)[1:]


def generate(
    model: MoEKVTransformer,
    prompts: list[list[int]],
    params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
    cache: str = "contiguous",
    record_logits: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    **cache_options,
) -> GenerationResult:
    """`params` may be one per prompt (own seeds), each a SamplingParams, a dict of its fields, or
    None (the defaults), as the engine takes them. cache_options (PAGED_OPTIONS, an unknown one is
    named) apply to cache="paged" only; without num_blocks its pool is sized for every prompt at
    once, and a pool given must hold the batch at its worst (check_pool_holds_batch), refused before
    any token otherwise. `record_logits` keeps the logits
    of every position processed (the equivalence tests compare them with a full forward)."""
    if not isinstance(model, MoEKVTransformer):
        raise ValueError(f"model must be a MoEKVTransformer, got {type(model).__name__}")
    own = ", ".join(keywords_of(generate))
    check_keywords(
        "generate", cache_options, PAGED_OPTIONS, f"{own}, and for cache='paged' {', '.join(PAGED_OPTIONS)}"
    )
    check_choice("cache", cache, CACHE_KINDS)
    if cache_options and cache != "paged":
        raise ValueError(f"{sorted(cache_options)} apply to cache='paged' only, not cache={cache!r}")
    check_flag("record_logits", record_logits)  # the cache's own flags: make_paged_cache checks them
    check_callable("on_token", on_token, "(prompt index, token)")
    config = model.config
    prompts, per_prompt = map(list, zip(*check_batch(prompts, params, config, "params")))
    if cache == "paged" and "num_blocks" not in cache_options and "max_num_seqs" not in cache_options:
        cache_options = {**cache_options, "max_num_seqs": len(prompts)}  # a pool for all of them
    generators = [p.generator() for p in per_prompt]
    generated: list[list[int]] = [[] for _ in prompts]
    logits_log: list[list[torch.Tensor]] | None = [[] for _ in prompts] if record_logits else None

    def active() -> list[int]:
        return [i for i in range(len(prompts)) if len(generated[i]) < per_prompt[i].max_new_tokens]

    def sample(logits, rows: list[int]) -> None:
        """One token for each sequence of `rows` from its row of logits (b, V)."""
        tokens = sample_rows(logits, [per_prompt[i] for i in rows], [generators[i] for i in rows])
        for i, token in zip(rows, tokens):
            generated[i].append(token)
            if on_token is not None:
                on_token(i, token)

    # inference mode, not only no_grad: 8% of a dense decode step (measured); results leave it as copies
    with torch.inference_mode():
        if cache == "none":
            counts = _generate_recompute(model, prompts, generated, logits_log, active, sample)
        else:
            kv_cache = (
                ContiguousKVCache(config.num_hidden_layers, config.num_attention_experts)
                if cache == "contiguous"
                else make_paged_cache(model, **cache_options)
            )
            if cache == "paged":
                check_pool_holds_batch(kv_cache, prompts, per_prompt, cache_options)
            counts = _generate_cached(model, kv_cache, prompts, generated, logits_log, active, sample)
    logits = [torch.cat(chunks) for chunks in logits_log] if record_logits else None  # new tensors
    return GenerationResult(prompts, generated, counts.clone(), logits, {"cache": cache, **cache_options})


def check_pool_holds_batch(kv_cache: PagedKVCache, prompts, per_prompt, cache_options: dict) -> None:
    """ValueError, before any token, when the pool may not hold the batch: generate keeps every
    sequence to the end (static batching: it frees none and preempts none), so the pool (each
    device's, with per-device pools) must hold all of them at once at their worst, prompt + max_new_tokens
    - 1 cached tokens each (the last sampled token is never fed back). The engine, which preempts,
    needs each request to fit alone only."""
    manager = kv_cache.manager
    config = kv_cache.config
    L = config.num_hidden_layers
    K = config.num_attention_experts_per_tok
    P = manager.block_size
    num_tokens = torch.tensor([len(p) + q.max_new_tokens - 1 for p, q in zip(prompts, per_prompt)])  # (B,)
    limits = manager.layer_limits  # a budgeted manager's B of each layer; None: no cap
    worst = worst_case_lifetime_blocks_per_device(
        num_tokens,
        K,
        P,
        manager.placement.of_sequences(range(len(prompts))),  # (B, L, E)
        manager.num_devices,
        None if limits is None else max(limits),
    ).sum(0)  # (D,)
    have = manager.blocks_per_device  # (D,)
    if bool((worst <= have).all()):
        return
    B = len(prompts)
    held = (
        f"generate holds its {B} sequence{'s' if B > 1 else ''} ({int(num_tokens.sum()):,} cached tokens) "
        "to the end, freeing none"
    )
    k_min = K if config.attention_routing == "topk" else 1
    least = sum(min_lifetime_blocks(int(t), L, k_min, P) for t in num_tokens.tolist())
    shape = f"{L} layers, up to {K} experts per token, block size {P}"
    needs = f"{held}, and may need up to {int(worst.sum())} blocks ({shape}; at least {least})"
    if "num_blocks" in cache_options and "blocks_per_device" not in cache_options:
        raise ValueError(
            f"num_blocks={int(have.sum())} is too small for this batch: {needs}; allowed: num_blocks >= "
            f"{int(worst.sum())}, or no num_blocks (a pool for every prompt at max_position_embeddings tokens)"
        )
    if "blocks_per_device" not in cache_options:  # sized by max_num_seqs: that many sequences at their worst
        max_num_seqs = cache_options["max_num_seqs"]
        smallest = -(-int(worst.sum()) * max_num_seqs // int(have.sum()))
        raise ValueError(
            f"max_num_seqs={max_num_seqs} sizes a pool of {int(have.sum())} blocks, too small for this "
            f"batch: {needs}; allowed: max_num_seqs >= {smallest}, or num_blocks >= {int(worst.sum())}"
        )
    raise ValueError(
        f"blocks_per_device={have.tolist()} is too small for this batch: {held}, and its rows on each "
        f"device may need up to {worst.tolist()} blocks ({shape}); allowed: blocks_per_device >= "
        f"{worst.tolist()} entry by entry"
    )


def _generate_cached(model, kv_cache, prompts, generated, logits_log, active, sample):
    device = next(model.parameters()).device
    B = len(prompts)
    # prefill: all prompts as one flat ragged batch
    lengths = [len(p) for p in prompts]
    tokens = torch.tensor([t for p in prompts for t in p], device=device)  # (N,)
    seq_ids = torch.repeat_interleave(torch.arange(B, device=device), torch.tensor(lengths, device=device))
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])  # (N,)
    logits = model.forward_cached(tokens, seq_ids, positions, kv_cache).logits  # (N, V)
    if logits_log is not None:
        for i, chunk in enumerate(torch.split(logits, lengths)):
            logits_log[i].append(chunk.float() if chunk.dtype == torch.bfloat16 else chunk)
    sample(logits[torch.tensor(lengths, device=device).cumsum(0) - 1], list(range(B)))
    # decode: one token per still-active sequence
    while rows := active():
        tokens = torch.tensor([generated[i][-1] for i in rows], device=device)  # (b,)
        seq_ids = torch.tensor(rows, device=device)
        positions = torch.tensor([lengths[i] + len(generated[i]) - 1 for i in rows], device=device)
        logits = model.forward_cached(tokens, seq_ids, positions, kv_cache).logits  # (b, V)
        if logits_log is not None:
            for row, i in enumerate(rows):
                logits_log[i].append(logits[row : row + 1])
        sample(logits, rows)
    return kv_cache.token_counts(list(range(B)))


def _right_padded(sequences: list[list[int]], device) -> torch.Tensor:
    """(b, T) token ids, each sequence right-padded with zeros to the longest."""
    return pad_sequence([torch.tensor(s) for s in sequences], batch_first=True).to(device)


def _generate_recompute(model, prompts, generated, logits_log, active, sample):
    device = next(model.parameters()).device
    first = True
    while rows := active():
        sequences = [prompts[i] + generated[i] for i in rows]
        logits = model(_right_padded(sequences, device)).logits  # (b, T, V)
        ends = [len(s) - 1 for s in sequences]
        if logits_log is not None:
            for row, (i, n) in enumerate(zip(rows, ends)):
                logits_log[i].append(logits[row, : n + 1] if first else logits[row, n : n + 1])
        first = False
        sample(logits[torch.arange(len(rows)), torch.tensor(ends)], rows)
    # what a cache would hold: every processed token (the last sampled one is never fed back)
    batch = _right_padded([p + g[:-1] for p, g in zip(prompts, generated)], device)
    lengths = torch.tensor([len(p) + len(g) - 1 for p, g in zip(prompts, generated)], device=device)
    valid = torch.arange(batch.shape[1], device=device) < lengths[:, None]  # (B, T)
    routing = model(batch).attention_routing
    counts = [(r.selected & valid[..., None]).sum(1) for r in routing]  # L x (B, E)
    return torch.stack(counts, dim=1).cpu()  # (B, L, E)
