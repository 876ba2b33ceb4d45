"""analysis.budget_map (notebook 10's map): what each (expert, position) of a layer became under a row
budget. Held against a reference built another way: the paged cache fed one token at a time, a pair
accepted when its position is among the row's kept positions right after its own step, kept when it
is still there at the end; on random models (float64, every policy, dense and routed) and on the
embedded model (float32, the notebook's snippet). At layer 0, whose router sees only the token, the
codes of drop and window are also written out from the rules alone. And the figure of it."""

import pytest
import torch
from helpers import random_model, random_prompts, small_config

from moekv_ref.analysis import BUDGET_MAP_CODES, budget_map
from moekv_ref.cache import BudgetedPagedKVCache
from moekv_ref.cache.budget import BUDGET_POLICIES, RowBudget
from moekv_ref.checkpoint import load_default_model
from moekv_ref.course.exercise_10 import exercise_10_text
from moekv_ref.plots.capacity import plot_budget_map
from moekv_ref.prompts import encode

NOT_ROUTED, KEPT, EVICTED, REFUSED = (
    BUDGET_MAP_CODES.index(name) for name in ("not routed", "kept", "evicted", "refused")
)


def one_token_at_a_time(model, tokens: torch.Tensor, budget: RowBudget) -> torch.Tensor:
    """(L, E, T) codes from a paged cache fed the tokens one decode step each."""
    config = model.config
    L, E, T = config.num_hidden_layers, config.num_attention_experts, len(tokens)
    cache = BudgetedPagedKVCache.for_model(model, block_size=4, max_num_seqs=1, budget=budget)
    manager = cache.manager
    routed = torch.zeros(L, E, T, dtype=torch.bool)
    accepted = torch.zeros(L, E, T, dtype=torch.bool)
    with torch.inference_mode():
        for t in range(T):
            output = model.forward_cached(
                tokens[t : t + 1], torch.zeros(1, dtype=torch.int64), torch.tensor([t]), cache
            )
            for layer in range(L):
                routed[layer, :, t] = output.attention_routing[layer].selected[0]
                rows = manager.rows([0] * E, layer, list(range(E)))
                for e, held in enumerate(manager.budget.kept_positions(rows)):
                    accepted[layer, e, t] = t in held
    kept = torch.zeros(L, E, T, dtype=torch.bool)
    for layer in range(L):
        for e, held in enumerate(manager.budget.kept_positions(manager.rows([0] * E, layer, list(range(E))))):
            kept[layer, e, held] = True
    assert not (accepted & ~routed).any() and not (kept & ~accepted).any()
    codes = torch.full((L, E, T), NOT_ROUTED)
    codes[routed] = REFUSED
    codes[accepted] = EVICTED
    codes[kept] = KEPT
    return codes


@pytest.mark.parametrize(
    "mode,policy",
    [
        (mode, policy)
        for mode in ("expert", "dense")
        for policy in BUDGET_POLICIES
        if not (mode == "dense" and policy == "router_score")
    ],
)
def test_the_map_is_what_a_cache_fed_one_token_at_a_time_keeps(mode, policy):
    model = random_model(small_config(mode), seed=5)
    tokens = torch.tensor(random_prompts([40], model.config.vocab_size, seed=2)[0])
    budget = RowBudget(5, policy, num_sinks=2)
    reference = one_token_at_a_time(model, tokens, budget)
    for layer in range(model.config.num_hidden_layers):
        codes, counts = budget_map(model, tokens, layer, budget)
        assert codes.dtype == torch.int64 and torch.equal(codes, reference[layer]), (policy, layer)
        assert counts == {name: int((codes == i).sum()) for i, name in enumerate(BUDGET_MAP_CODES)}
        assert list(counts) == list(BUDGET_MAP_CODES) and sum(counts.values()) == codes.numel()
    changed = {"drop": REFUSED, "window": EVICTED, "heavy_hitter": EVICTED}.get(policy)
    if changed is not None:  # the budget binds, the way its policy does
        assert (reference == changed).any()
    else:  # router_score: evicts and refuses
        assert (reference == EVICTED).any() and (reference == REFUSED).any()


@pytest.mark.parametrize("policy", ["window", "router_score"])
def test_the_map_of_the_embedded_model_on_the_notebook_s_snippet(policy):
    """float32, the trained routers, 154 tokens: the same codes as the cache fed token by token."""
    model = load_default_model()
    tokens = torch.tensor(encode(exercise_10_text()))
    budget = RowBudget(16, policy)
    reference = one_token_at_a_time(model, tokens, budget)
    for layer in (0, 3):
        codes, counts = budget_map(model, tokens, layer, budget)
        assert torch.equal(codes, reference[layer]), layer
        assert counts["kept"] + counts["evicted"] + counts["refused"] == 2 * len(tokens)  # top-2: routed
        assert ((codes == KEPT).sum(1) <= 16).all()


def test_drop_and_window_at_layer_0_follow_their_rules():
    """Layer 0's router sees only the token, so its routing is the same with or without a budget:
    drop keeps each row's first B routed tokens and refuses the rest; window keeps the first
    num_sinks and the newest B - num_sinks, and evicts the middle."""
    model = load_default_model()
    tokens = torch.tensor(encode(exercise_10_text()))
    with torch.inference_mode():
        routed = model(tokens[None]).attention_routing[0].selected[0].T  # (E, T)
    B, sinks = 12, 4
    for policy in ("drop", "window"):
        expected = torch.full(routed.shape, NOT_ROUTED)
        for e in range(routed.shape[0]):
            positions = routed[e].nonzero().squeeze(1)
            if policy == "drop":
                expected[e, positions[:B]] = KEPT
                expected[e, positions[B:]] = REFUSED
            else:
                expected[e, positions] = EVICTED
                expected[e, positions[:sinks]] = KEPT
                expected[e, positions[max(0, len(positions) - (B - sinks)) :]] = KEPT
        codes, _ = budget_map(model, tokens, 0, RowBudget(B, policy, num_sinks=sinks))
        assert torch.equal(codes, expected), policy


def test_a_budget_no_row_reaches_keeps_every_routed_token():
    model = load_default_model()
    tokens = encode(exercise_10_text())
    with torch.inference_mode():
        routing = model(torch.tensor([tokens])).attention_routing
    for layer in range(model.config.num_hidden_layers):
        for policy in BUDGET_POLICIES:
            codes, counts = budget_map(model, tokens, layer, RowBudget(len(tokens), policy))
            assert torch.equal(codes == KEPT, routing[layer].selected[0].T), (layer, policy)
            assert counts["evicted"] == counts["refused"] == 0


def test_bad_arguments_are_refused_with_their_reason():
    model = random_model(small_config(), seed=0)
    with pytest.raises(ValueError, match="RowBudget"):
        budget_map(model, [1, 2, 3], 0, 4)
    for layer in (-1, 2, 1.0, True):
        with pytest.raises(ValueError, match="layer"):
            budget_map(model, [1, 2, 3], layer, RowBudget(2))
    with pytest.raises(ValueError, match="empty"):
        budget_map(model, [], 0, RowBudget(2))


def test_the_figure_draws_every_code_at_notebook_width():
    model = load_default_model()
    budget = RowBudget(16, "router_score")
    codes, counts = budget_map(model, encode(exercise_10_text()), 1, budget)
    assert all(counts[name] for name in BUDGET_MAP_CODES)  # every colour appears
    fig = plot_budget_map(codes, 1, budget)
    width, height = fig.get_size_inches() * fig.dpi
    assert width <= 1100
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [f"{name} ({counts[name]})" for name in BUDGET_MAP_CODES]
    kept = [
        t.get_text()
        for t in fig.axes[0].texts
        if " of " in t.get_text() and t.get_text() != " kept of routed"
    ]
    assert kept == [
        f" {int((codes[e] == KEPT).sum())} of {int((codes[e] != NOT_ROUTED).sum())}"
        for e in range(codes.shape[0])
    ]


def test_budget_map_refuses_what_is_not_a_budget_as_a_cache_does():
    """The budget is checked by the rule every cache and manager uses for a part, naming the value."""
    model = random_model(small_config("expert", "topk"), seed=0)
    with pytest.raises(ValueError, match=r"budget='drop' is a str; allowed: a RowBudget"):
        budget_map(model, [1, 2], 0, "drop")
    with pytest.raises(ValueError, match=r"budget=None: budget_map needs a RowBudget"):
        budget_map(model, [1, 2], 0, None)
