"""What the router learned (expert load, router entropy, the characters each expert prefers), what a
decode step costs, the model's real routing as a RoutingTrace for the simulator (moekv_ref/sim), and
what a row budget did to each (expert, position) of a layer (`budget_map`, notebook 10).

Read the statistics against an untrained model (tests/test_analysis.py does): a random router
projects each byte's embedding, so it too prefers kinds of characters and loads unevenly. Training
adds confidence (lower entropy), most in the deeper layers, where routing depends on context."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch.nn.functional import one_hot

from .cache import BudgetedPagedKVCache, ContiguousKVCache
from .cache.budget import RowBudget, check_budget_kind
from .generate import generate
from .prompts import encode
from .sampling import SamplingParams
from .sim.traces import RoutingTrace
from .validation import check_int

CHARACTER_CLASSES = {
    "lowercase": lambda c: "a" <= c <= "z",
    "uppercase": lambda c: "A" <= c <= "Z",
    "digit": lambda c: c.isdigit(),
    "space": lambda c: c == " ",
    "newline": lambda c: c == "\n",
    "quote": lambda c: c in "'\"",
    "bracket": lambda c: c in "()[]{}",
    "operator": lambda c: c in "=+-*/<>%&|^~!",
    "separator": lambda c: c in ".,:;",
    "other": lambda c: True,
}


def heldout_text() -> str:
    """Python source the model never trained on (a frozen copy of an early model.py of this package):
    fixed text, so that statistics over it stay the same as the package changes."""
    return (Path(__file__).parent / "data" / "heldout.py.txt").read_text()


def character_class(byte: int) -> str:
    char = chr(byte) if byte < 128 else "\x80"
    return next(name for name, test in CHARACTER_CLASSES.items() if test(char))  # "other": any


@torch.no_grad()
def routing_statistics(model, text: str, max_tokens: int | None = None) -> dict:
    """Per layer over `text` (in windows of the trained context): load (fraction of selections per
    expert), mean router entropy in bits, experts per token, and per expert the character class it
    is most enriched for (P(class | expert) / P(class))."""
    tokens = encode(text)[: max_tokens or None]
    window = min(256, model.config.max_position_embeddings)
    chunks = [tokens[i : i + window] for i in range(0, len(tokens), window)]
    classes = list(CHARACTER_CLASSES)
    class_of = torch.tensor([classes.index(character_class(t)) for t in tokens])
    routings = [model(torch.tensor([chunk])).attention_routing for chunk in chunks]
    num_experts = model.config.num_attention_experts
    class_share = torch.bincount(class_of, minlength=len(classes)).double() / len(tokens)
    layers = []
    for layer in range(model.config.num_hidden_layers):
        selected = torch.cat([r[layer].selected[0].cpu() for r in routings])  # (T, E)
        probs = torch.cat([r[layer].probs[0].double().cpu() for r in routings])  # (T, E)
        load = selected.sum(0).double() / selected.sum()
        entropy = -(probs * probs.clamp_min(1e-30).log2()).sum(-1).mean().item()
        held = selected.T.double() @ one_hot(class_of, len(classes)).double()  # (E, classes)
        share = held / held.sum(1, keepdim=True)
        enrichment = share / class_share.clamp_min(1e-12)
        enrichment[:, class_share < 0.01] = 0  # ignore classes too rare to judge
        preferences = [
            {
                "expert": e,
                "class": classes[b],
                "enrichment": float(enrichment[e, b]),
                "share": float(share[e, b]),
            }
            if held[e].any()
            else {"expert": e, "class": None, "enrichment": 0.0}
            for e, b in enumerate(enrichment.argmax(1).tolist())
        ]
        layers.append(
            {
                "layer": layer,
                "load": load.tolist(),
                "max_load_over_uniform": float(load.max() * num_experts),
                "min_load_over_uniform": float(load.min() * num_experts),
                "router_entropy_bits": entropy,
                "uniform_entropy_bits": math.log2(num_experts),
                "experts_per_token": float(selected.sum(-1).double().mean()),
                "preferences": preferences,
            }
        )
    return {"num_tokens": len(tokens), "layers": layers}


def format_routing_statistics(stats: dict) -> str:
    lines = [f"routing statistics over {stats['num_tokens']} tokens"]
    for layer in stats["layers"]:
        load = " ".join(f"{x:.2f}" for x in layer["load"])
        lines.append(
            f"layer {layer['layer']}: load [{load}]  max/uniform {layer['max_load_over_uniform']:.2f}  "
            f"entropy {layer['router_entropy_bits']:.2f} bits (uniform {layer['uniform_entropy_bits']:.2f})  "
            f"experts/token {layer['experts_per_token']:.2f}"
        )
        prefs = ", ".join(f"e{p['expert']}:{p['class']} x{p['enrichment']:.1f}" for p in layer["preferences"])
        lines.append(f"   prefers: {prefs}")
    return "\n".join(lines)


@torch.no_grad()
def route_prompt(model, text: str) -> list[torch.Tensor]:
    """Which experts each token of `text` goes to: one (T, E) bool tensor per layer."""
    tokens = encode(text)
    if not tokens:
        raise ValueError("the prompt is empty: type at least one character")
    output = model(torch.tensor([tokens]))
    return [routing.selected[0].cpu() for routing in output.attention_routing]


def decode_flops(config, context_length: int, cached: bool) -> int:
    """Multiply-adds x 2 for ONE decode step at `context_length` tokens already in the sequence:
    recompute runs every token through every layer again, cached only the new one (its attention
    reads the cache). Attention is counted for an average expert holding k/E of the tokens."""
    D, H, Hkv, Dh = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    k, E = config.num_attention_experts_per_tok, config.num_attention_experts
    projections = k * (D * H * Dh * 2 + D * Hkv * Dh * 2)  # q, o and k, v
    ffn = config.num_experts_per_tok * 3 * D * config.moe_intermediate_size
    router = D * (E + config.num_local_experts)
    per_token = config.num_hidden_layers * (projections + ffn + router) + D * config.vocab_size
    held = (context_length + 1) * k / E  # tokens per expert cache
    attention_per_query = config.num_hidden_layers * k * 2 * H * Dh * held
    if cached:
        return 2 * (per_token + attention_per_query)
    tokens = context_length + 1
    return 2 * (tokens * per_token + tokens * attention_per_query / 2)  # causal: half on average


def time_decode_step(model, context_length: int, cached: bool, clock, num_cached_steps: int) -> float:
    """Seconds for one decode step after `context_length` tokens: recompute, one full forward;
    cached, the mean of the last `num_cached_steps` decode tokens after an untimed prefill (a few in
    a row average out the jitter; their contexts cost the same within a few percent here)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (context_length + 1,), generator=generator)
    if not cached:
        start = clock()
        model(tokens[None])
        return clock() - start
    num_steps = max(1, min(num_cached_steps, context_length))
    first = context_length + 1 - num_steps  # the first timed token's position
    cache = ContiguousKVCache(model.config.num_hidden_layers, model.config.num_attention_experts)
    zeros = torch.zeros(first, dtype=torch.long)
    model.forward_cached(tokens[:first], zeros, torch.arange(first), cache)
    start = clock()
    for position in range(first, context_length + 1):
        model.forward_cached(tokens[position, None], zeros[:1], torch.tensor([position]), cache)
    return (clock() - start) / num_steps


@torch.no_grad()
def time_decode_steps(
    model, lengths: list[int], repeats: int = 5, clock=time.perf_counter, num_cached_steps: int = 8
) -> dict[int, tuple[float, float]]:
    """{t: (recompute seconds, cached seconds)} after each t in `lengths`: the best of `repeats`
    rounds, each timing every (t, recompute / cached) once, after an untimed warm-up round. Rounds
    spread a burst of the machine's load over every length (notebook 01 tells why)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    best = {(t, cached): float("inf") for t in lengths for cached in (False, True)}
    for round_index in range(repeats + 1):  # round 0: warm-up, not kept
        for t in lengths:
            for cached in (False, True):
                seconds = time_decode_step(model, t, cached, clock, num_cached_steps)
                if round_index:
                    best[t, cached] = min(best[t, cached], seconds)
    return {t: (best[t, False], best[t, True]) for t in lengths}


@torch.no_grad()
def record_model_trace(
    model, prompts: list[list[int]], output_lens: list[int], name: str = "model"
) -> RoutingTrace:
    """The model's attention routing on these prompts, continued greedily, with their tokens (the
    trace's token_ids: a prefix cache finds what two prompts share). Routing is causal, so one full
    forward over each finished sequence gives the decisions the cached decode made."""
    config = model.config
    if len(prompts) != len(output_lens):
        raise ValueError(f"{len(prompts)} prompts but {len(output_lens)} output lengths")
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in output_lens]
    result = generate(model, prompts, params, cache="contiguous")
    parts = []
    token_ids = []
    for prompt, generated in zip(prompts, result.tokens):
        token_ids += prompt + generated[:-1]  # the last sampled token is never stored
        routing = model(torch.tensor([prompt + generated[:-1]])).attention_routing  # L x (1, T, E)
        selected = torch.stack([r.selected[0] for r in routing], dim=1)  # (T, L, E)
        K = config.num_attention_experts_per_tok
        # selected experts first (in expert order), padded with -1 up to K
        order = torch.sort((~selected).to(torch.int8), dim=-1, stable=True).indices[..., :K]
        chosen = torch.where(torch.gather(selected, -1, order), order, -1)
        parts.append(chosen.to(torch.int16))
    offsets = torch.tensor([0] + [p.shape[0] for p in parts], dtype=torch.int64).cumsum(0)
    bytes_per_value = next(model.parameters()).element_size()
    return RoutingTrace(
        torch.cat(parts),
        offsets,
        torch.tensor([len(p) for p in prompts]),
        config.num_attention_experts,
        config.kv_bytes_per_entry(bytes_per_value),
        name,
        token_ids=torch.tensor(token_ids, dtype=torch.int64),
    )


# What budget_map's codes mean: code i is BUDGET_MAP_CODES[i].
BUDGET_MAP_CODES = ("not routed", "kept", "evicted", "refused")


@torch.inference_mode()
def budget_map(model, tokens, layer: int, budget: RowBudget) -> tuple[torch.Tensor, dict[str, int]]:
    """What each (expert, position) of one layer became when one sequence of `tokens` (T,) went
    through a cache with a row budget (cache/budget.py): an (E, T) int64 tensor of codes,

        0 not routed  the router did not send the token to this expert
        1 kept        routed, taken by the row, and still in it at the end
        2 evicted     taken by the row when it arrived, then replaced by a later token
                      (window, heavy_hitter, router_score)
        3 refused     routed to a full row and turned away on arrival (drop, router_score)

    and how many cells hold each code, {name: count} in BUDGET_MAP_CODES' order.

    The routing and what each row keeps at the end are the paged cache's (the tokens as one prefill,
    then `kept_positions`); which routed pairs the rows took on arrival is the budgeted recompute's
    (`model(tokens, budget=...)`, whose routing is then the pairs the rows accepted), which the tests
    hold equal to the cache. From layer 1 on, the routing itself is the one under the budget: a token
    refused or evicted below changes the hidden states that later routers see."""
    check_budget_kind(budget)
    if budget is None:
        raise ValueError("budget=None: budget_map needs a RowBudget (moekv_ref.cache.budget)")
    config = model.config
    layer = check_int("layer", layer, 0, config.num_hidden_layers - 1, "a layer of the model")
    tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    if tokens.numel() == 0:
        raise ValueError("tokens is empty: give at least one token")
    T, E = tokens.numel(), config.num_attention_experts
    device = next(model.parameters()).device
    tokens = tokens.to(device)

    cache = BudgetedPagedKVCache.for_model(model, max_num_seqs=1, budget=budget)
    positions = torch.arange(T, device=device)
    output = model.forward_cached(tokens, torch.zeros_like(positions), positions, cache)
    routed = output.attention_routing[layer].selected.T.cpu()  # (E, T)
    rows = cache.manager.rows([0] * E, layer, list(range(E)))
    kept = torch.zeros(E, T, dtype=torch.bool)
    for expert, held in enumerate(cache.manager.budget.kept_positions(rows)):
        kept[expert, held] = True
    accepted = model(tokens[None], budget=budget).attention_routing[layer].selected[0].T.cpu()  # (E, T)

    codes = torch.zeros(E, T, dtype=torch.int64)  # not routed
    codes[routed] = BUDGET_MAP_CODES.index("refused")
    codes[routed & accepted] = BUDGET_MAP_CODES.index("evicted")
    codes[kept] = BUDGET_MAP_CODES.index("kept")  # the cache holds only what it was routed
    counts = torch.bincount(codes.reshape(-1), minlength=len(BUDGET_MAP_CODES)).tolist()
    return codes, dict(zip(BUDGET_MAP_CODES, counts))
