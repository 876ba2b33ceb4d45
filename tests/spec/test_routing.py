import torch
from helpers import random_model, random_prompts, small_config

from moekv_ref.checkpoint import load_default_model
from moekv_ref.generate import generate
from moekv_ref.routing import route
from moekv_ref.sampling import SamplingParams


def test_topk_selects_exactly_k_and_gates_sum_to_one():
    logits = torch.randn(50, 7, generator=torch.Generator().manual_seed(0))
    routing = route(logits, "topk", 3)
    assert (routing.experts_per_token == 3).all()
    assert torch.allclose(routing.gates.sum(-1), torch.ones(50))
    # the selected experts are the 3 most probable
    assert (
        routing.selected == torch.zeros_like(routing.selected).scatter(-1, logits.topk(3).indices, True)
    ).all()


def test_threshold_keeps_mass_between_one_and_kmax():
    logits = 3 * torch.randn(400, 8, generator=torch.Generator().manual_seed(1))
    routing = route(logits, "threshold", 4, threshold=0.7)
    counts = routing.experts_per_token
    assert counts.min() >= 1 and counts.max() <= 4 and len(counts.unique()) > 1
    mass = (routing.probs * routing.selected).sum(-1)
    # below k_max, the kept mass reaches the threshold; dropping the last kept expert would not
    full = counts < 4
    assert (mass[full] >= 0.7 - 1e-12).all()
    smallest_kept = (
        torch.where(routing.selected, routing.probs, torch.ones_like(routing.probs)).min(-1).values
    )
    assert (mass - smallest_kept < 0.7).all()


def test_topk_caches_hold_exactly_k_times_T_per_layer():
    model = load_default_model("topk")
    prompts = [list(b"def add(a, b):\n    return a + b\n"), list(b"class A:")]
    result = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    k = model.config.num_attention_experts_per_tok
    for i, prompt in enumerate(prompts):
        processed = len(prompt) + 10 - 1
        per_layer = result.cache_counts[i].sum(-1)  # (L,)
        assert per_layer.tolist() == [k * processed] * model.config.num_hidden_layers
        assert (result.cache_counts[i] > 0).sum() > k  # the split itself varies


def test_random_topk_config_identity():
    model = random_model(small_config("expert", "topk"), seed=5)
    prompts = random_prompts([13, 8], model.config.vocab_size, seed=5)
    result = generate(model, prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
    for i, prompt in enumerate(prompts):
        assert result.cache_counts[i].sum(-1).tolist() == [3 * (len(prompt) + 3)] * 2


def test_threshold_routing_equal_lengths_different_totals():
    """Two prompts of equal length need different cache sizes under threshold routing."""
    model = load_default_model("threshold")
    a, b = list(b"for i in range(10):"), list(b"    return None  # ")
    assert len(a) == len(b)
    result = generate(model, [a, b], SamplingParams(max_new_tokens=1, temperature=0.0))
    total_a, total_b = result.cache_counts[0].sum().item(), result.cache_counts[1].sum().item()
    assert total_a != total_b, (total_a, total_b)
    # and both lie between the top-1 and top-k_max extremes
    for total in (total_a, total_b):
        assert len(a) * 4 <= total <= len(a) * 4 * model.config.num_attention_experts_per_tok
