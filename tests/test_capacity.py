"""Capacity in training and its causal inference (routing.apply_capacity, ModelConfig.attention_capacity),
and the capacity study's accounting (apps/capacity.py).

Token choice with a capacity drops the tokens after an expert's first C, which is causal: the training
forward (one mask over the window), the budgeted recompute with a `drop` budget of C (token by token)
and the paged cache the model builds by default all agree. Expert choice keeps each expert's C
best-scored tokens of the window, which looks ahead: its cache keeps the best so far (router_score),
equal to the budgeted recompute, and differs from the training forward once a row fills.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import prefill_then_decode, random_model, random_prompts, small_config

from moekv_ref import jsonout
from moekv_ref.apps import capacity
from moekv_ref.cache import make_paged_cache
from moekv_ref.cache.budget import RowBudget, model_budget
from moekv_ref.config import ModelConfig
from moekv_ref.engine import LLMEngine
from moekv_ref.generate import generate
from moekv_ref.model import MoEKVTransformer
from moekv_ref.plots.capacity import frontier_rows
from moekv_ref.routing import Routing, apply_capacity
from moekv_ref.sampling import SamplingParams


def test_apply_capacity_keeps_the_first_c_or_the_best_c():
    probs = torch.tensor([[[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.6, 0.4]]])  # (1, T=4, E=2)
    selected = torch.tensor([[[True, False], [True, True], [True, False], [True, True]]])
    routing = Routing(probs, selected, probs * selected)
    dropped = apply_capacity(routing, "topk", 2)
    assert dropped.selected[0, :, 0].tolist() == [True, True, False, False]  # first two routed to 0
    assert dropped.selected[0, :, 1].tolist() == [False, True, False, True]  # only two were
    assert torch.equal(dropped.gates, probs * dropped.selected)  # not renormalised
    chosen = apply_capacity(Routing(probs, torch.ones_like(selected), probs), "expert_choice", 2)
    assert chosen.selected[0, :, 0].tolist() == [True, False, True, False]  # 0.9 and 0.7
    assert chosen.selected[0, :, 1].tolist() == [False, True, False, True]  # 0.8 and 0.4


@pytest.mark.parametrize("routing", ["topk", "threshold"])
def test_token_choice_capacity_is_causal_training_equals_cache_and_recompute(routing):
    """Trained with a capacity of 3: model(x) (one mask), model(x, budget=drop 3) and the paged cache
    the model builds by default (model_budget: drop 3) give the same logits (float64, 1e-10)."""
    model = random_model(small_config("expert", routing, attention_capacity=3), seed=4)
    sequences = torch.tensor(random_prompts([20, 20], model.config.vocab_size, seed=2))
    with torch.inference_mode():
        trained = model(sequences).logits
        recompute = model(sequences, budget=RowBudget(3, "drop")).logits
        cache = make_paged_cache(model, block_size=2)
        cached = prefill_then_decode(model, cache, sequences, prefill=7)
    assert cache.manager.budget.policy == "drop" and cache.manager.budget.num_refused > 0
    assert (trained - recompute).abs().max() <= 1e-10
    assert (cached - recompute).abs().max() <= 1e-10


def test_expert_choice_decodes_causally_and_differs_from_its_training_rule():
    """Expert choice with C = 4 of 5 experts: the cache (router_score 4, built by default) equals the
    budgeted recompute. The training rule picks each expert's best 4 of the whole window, so a token
    can lose its place to a later one before it is ever decoded: it differs from the causal rule on
    windows longer than C, and on a window of C tokens (every token chosen by both) it agrees."""
    config = small_config(
        "expert",
        num_attention_experts=5,
        num_attention_experts_per_tok=5,
        attention_routing="expert_choice",
        attention_capacity=4,
    )
    model = random_model(config, seed=8)
    sequences = torch.tensor(random_prompts([18, 18], model.config.vocab_size, seed=3))
    with torch.inference_mode():
        trained = model(sequences).logits
        causal = model(sequences, budget=model_budget(config)).logits
        cache = make_paged_cache(model, block_size=2)
        cached = prefill_then_decode(model, cache, sequences, prefill=5)
        short = sequences[:, :4]
        short_gap = (model(short).logits - model(short, budget=model_budget(config)).logits).abs().max()
    assert cache.manager.budget.policy == "router_score"
    assert (cached - causal).abs().max() <= 1e-10
    assert (trained - causal).abs().max() > 1e-3
    assert short_gap <= 1e-10


def test_expert_choice_needs_every_expert_and_a_capacity():
    for fields in (
        dict(
            attention_routing="expert_choice",
            num_attention_experts=8,
            num_attention_experts_per_tok=2,
            attention_capacity=4,
        ),
        dict(attention_routing="expert_choice", num_attention_experts=8, num_attention_experts_per_tok=8),
    ):
        with pytest.raises(ValueError, match="expert_choice' lets each of several experts choose"):
            ModelConfig(**fields)
    with pytest.raises(ValueError, match="attention_capacity=-1"):
        ModelConfig(attention_capacity=-1)


def test_the_study_measures_what_the_rows_hold():
    """measure() on a random model: without a budget every routed entry is held (k x T x L entries of
    a top-k model); with a window of B, min(routed, B) per row; the pool rounds rows up to blocks."""
    model = capacity.variant_config("expert_topk")
    torch.manual_seed(0)
    net = MoEKVTransformer(model).eval()
    x = torch.randint(0, 256, (2, 64))
    y = torch.randint(0, 256, (2, 64))
    per_entry = model.kv_bytes_per_entry(4)
    exact = capacity.measure(net, x, y, None)
    assert exact["kv_bytes_per_token"] == model.num_hidden_layers * 2 * per_entry
    windowed = capacity.measure(net, x, y, RowBudget(4, "window"))
    routed = torch.stack([r.selected.sum(1) for r in net(x).attention_routing])  # (L, B, E)
    assert windowed["kv_bytes_per_token"] == routed.clamp(max=4).sum().item() * per_entry / x.numel()
    assert (
        windowed["pool_bytes_per_token"]
        == (-(-routed.clamp(max=4) // 16) * 16).sum().item() * per_entry / x.numel()
    )


def test_the_frontier_keeps_only_settings_nothing_smaller_beats():
    """c is beaten by b at the same size, d by b with fewer bytes; f holds 1% less than g (the same
    size) and is worse, so g replaces it."""
    table = [
        dict(variant="v", kv_bytes_per_token=b, bits_per_byte_mean=q, policy=p, budget_tokens=t)
        for b, q, p, t in (
            (100, 3.0, "a", 1),
            (200, 2.5, "b", 2),
            (200, 2.9, "c", 3),
            (300, 2.6, "d", 4),
            (400, 2.4, "e", 5),
            (495, 2.3, "f", 6),
            (500, 2.1, "g", 7),
        )
    ]
    assert [r["policy"] for r in frontier_rows(table, "v")] == ["a", "b", "e", "g"]


def test_the_results_quote_the_committed_study():
    """docs/results.md's capacity table is readme_table(figures/capacity.json), and each number of the prose
    under it is the JSON's (a hand-edited number fails)."""
    root = Path(__file__).resolve().parents[1]
    study = json.loads((root / "figures" / "capacity.json").read_text())
    results = (root / "docs" / "results.md").read_text()
    assert capacity.readme_table(study) in results
    prose = " ".join(results.split("## A budget per row", 1)[1].split("\n## ", 1)[0].split())
    table = {(r["variant"], r["policy"], r["budget_tokens"]): r["bits_per_byte_mean"] for r in study["table"]}

    def cost(variant, policy, tokens):
        return table[variant, policy, tokens] - table[variant, "none", None]

    beside = study["against_dense"]
    assert beside and all(row["verdict"] == "loses" and row["difference_ci95"][0] > 0 for row in beside)
    assert not gaps_told_apart(study)  # "three seeds cannot tell this price from none"
    best = min((r for r in beside if round(r["kv_bytes_per_token"]) == 512), key=lambda r: r["bits_per_byte"])
    gaps = study["train_inference_gap"]
    quoted = [
        f"`{best['variant']}` under `{best['policy']}` at B = {best['budget_tokens']}, "
        f"reaches {best['bits_per_byte']:.3f} "
        f"bits per byte against dense attention's {best['dense_bits_per_byte']:.3f} (`{best['dense_policy']}` at "
        f"B = {best['dense_budget_tokens']})",
        f"lie {min(r['difference'] for r in beside):.3f} to {max(r['difference'] for r in beside):.3f} bits per byte",
        f"gives {table['dense', 'window', 64]:.3f} against {table['dense', 'none', None]:.3f} with no budget",
        f"window of 16 gives {table['expert_topk', 'window', 16]:.3f} against {table['expert_topk', 'none', None]:.3f}",
        f"costs dense attention {cost('dense', 'drop', 64):.3f} bits per byte",
        f"costs `expert_topk` {cost('expert_topk', 'router_score', 16):.3f}",
        f"at 12.5% loses {cost('expert_topk_capacity', 'drop', 16):.3f} where the model trained without a capacity "
        f"loses {cost('expert_topk', 'drop', 16):.3f}",
        f"it is {table['expert_topk_capacity', 'none', None] - table['expert_topk', 'none', None]:.3f} worse",
        f"a gap of {gaps['expert_topk_capacity']['gap_mean']:.3f}",
        f"costs {gaps['expert_choice']['gap_mean']:.3f} bits per byte on average",
        "({:+.3f}, {:+.3f}, {:+.3f})".format(*gaps["expert_choice"]["gap"]),
        "the paired 95% interval, [{:.3f}, {:.3f}] (n = {})".format(
            *gaps["expert_choice"]["gap_ci95"], gaps["expert_choice"]["n"]
        ),
        f"Training took {study['train_seconds_total'] / 60:.0f} minutes",
        f"measuring {study['measure_seconds_total'] / 60:.0f} minutes",
    ]
    for phrase in quoted:
        assert phrase in prose, phrase


def test_the_engine_serves_a_model_with_a_capacity_as_generate_does():
    """A model trained with a capacity gets the budget it implies in the engine's cache too (and the
    scheduler's bounds with it): the engine's tokens are generate's."""
    model = random_model(small_config("expert", attention_capacity=3), seed=4, dtype=torch.float32)
    prompts = random_prompts([9, 4], model.config.vocab_size, seed=6)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine = LLMEngine(model, num_blocks=80, block_size=2)
    assert engine.cache.manager.budget.policy == "drop" and engine.scheduler.memory.max_row_tokens == 3
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == generate(
        model, prompts, params, cache="paged", block_size=2
    ).tokens


def gaps_told_apart(study: dict) -> bool:
    return study["train_inference_gap"]["expert_choice"]["told_apart_from_zero"]


def test_the_committed_summaries_are_what_the_code_makes_of_the_committed_runs():
    """figures/capacity.json's table, gaps, verdicts and frontiers equal capacity.summaries() of its
    own runs: a summary rule changed without re-reading the runs fails here."""
    study = json.loads((Path(__file__).resolve().parents[1] / "figures" / "capacity.json").read_text())
    fresh = json.loads(jsonout.dumps(capacity.summaries(study["runs"], list(study["variants"]))))
    for key, value in fresh.items():
        assert study[key] == value, key


def test_a_routed_point_beside_dense_is_judged_by_the_paired_t_test():
    """Seeds spread far more than the variants differ, but the routed point is 0.05 worse on every
    seed: "loses" (twice the larger spread would have said "ties"); with the sign flipping on one
    seed of three it "ties"; 0.05 better on every seed "beats"."""
    base = [2.5, 3.0, 3.5]

    def table(offsets):
        return [
            dict(variant="dense", policy="window", budget_tokens=8, kv_bytes_per_token=100.0,
                 bits_per_byte_mean=3.0, bits_per_byte=base, seeds=[0, 1, 2]),
            dict(variant="routed", policy="window", budget_tokens=2, kv_bytes_per_token=100.0,
                 bits_per_byte_mean=3.0 + sum(offsets) / 3,
                 bits_per_byte=[b + o for b, o in zip(base, offsets)], seeds=[0, 1, 2]),
        ]  # fmt: skip

    def verdict(offsets):
        (row,) = capacity.against_dense(table(offsets), ["dense", "routed"])
        return row["verdict"]

    assert verdict([0.05, 0.051, 0.049]) == "loses"
    assert verdict([-0.05, -0.051, -0.049]) == "beats"
    assert verdict([0.2, 0.15, -0.05]) == "ties"
