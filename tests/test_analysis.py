"""The evidence that the embedded model's routing is learned, not random, and the cost model of
notebook 01."""

import math

import pytest

from moekv_ref.analysis import decode_flops, heldout_text, route_prompt, routing_statistics
from moekv_ref.checkpoint import load_default_model
from moekv_ref.config import get_config


@pytest.fixture(scope="module")
def stats():
    return routing_statistics(load_default_model("topk"), heldout_text(), max_tokens=4000)


def test_routing_is_non_uniform_and_specialised(stats):
    assert stats["num_tokens"] == 4000
    for layer in stats["layers"]:
        assert layer["experts_per_token"] == 2.0  # top-2
        assert abs(sum(layer["load"]) - 1) < 1e-9
        assert layer["router_entropy_bits"] < layer["uniform_entropy_bits"] - 0.25
        assert layer["max_load_over_uniform"] > 1.2  # some expert >= 1.2x uniform load
        assert max(p["enrichment"] for p in layer["preferences"]) > 3  # and one kind of character 3x


def test_trained_routers_are_more_confident_than_random_ones(stats):
    """What training adds. An untrained router is NOT uniform: it projects each byte's embedding, so
    its experts also prefer kinds of characters and its loads are uneven (seen: enrichment up to 8x,
    max load 1.7-2.0x uniform). What differs is confidence: the trained routers' entropy is lower in
    every layer (seen: 2.44-2.70 bits against 2.76-2.82), most in the deeper layers, where routing
    depends on context rather than on the byte alone."""
    import torch

    from moekv_ref.model import MoEKVTransformer

    torch.manual_seed(0)
    untrained = routing_statistics(
        MoEKVTransformer(get_config("tiny")).eval(), heldout_text(), max_tokens=4000
    )
    gaps = [
        u["router_entropy_bits"] - t["router_entropy_bits"]
        for t, u in zip(stats["layers"], untrained["layers"])
    ]
    assert min(gaps) > 0.05 and sum(gaps) / len(gaps) > 0.15, gaps


def test_route_prompt_shapes_and_empty_prompt():
    selected = route_prompt(load_default_model("topk"), "def f(x):")
    assert len(selected) == 4 and selected[0].shape == (9, 8)
    assert all(int(s.sum()) == 18 for s in selected)
    with pytest.raises(ValueError, match="the prompt is empty"):
        route_prompt(load_default_model("topk"), "")


def test_decode_flops_cached_is_linear_recompute_quadratic():
    config = get_config("tiny")
    cached = [decode_flops(config, t, cached=True) for t in (64, 128, 256)]
    recompute = [decode_flops(config, t, cached=False) for t in (64, 128, 256)]
    assert cached[0] < cached[1] < cached[2] and cached[2] < 1.2 * cached[0]  # ~ constant per step
    assert recompute[1] > 1.9 * recompute[0] and recompute[2] > 1.9 * recompute[1]
    assert all(r > 30 * c for r, c in zip(recompute, cached))
    assert not math.isnan(decode_flops(config, 0, cached=True))


def test_time_decode_steps_warms_up_interleaves_and_keeps_the_best_round():
    """A fake clock that makes every step take 1 s, except 5 s for whatever runs in the warm-up
    round and a 9 s burst in the second kept round: each (t, mode) is timed once per round, the
    warm-up is dropped, and the best round hides the burst."""
    from moekv_ref.analysis import time_decode_steps

    model = load_default_model()
    now, calls = [0.0], []

    def clock():
        calls.append(now[0])
        if len(calls) % 2 == 0:  # the stop of a start/stop pair
            step = len(calls) // 2 - 1  # 0-based timed step
            per_round = 2 * 2  # 2 lengths x (recompute, cached)
            now[0] += 5.0 if step < per_round else 9.0 if step // per_round == 2 else 1.0
        return now[0]

    measured = time_decode_steps(model, [3, 5], repeats=2, clock=clock, num_cached_steps=1)
    assert len(calls) == 2 * 2 * 2 * 3  # start + stop, 2 lengths, 2 modes, warm-up + 2 rounds
    assert measured == {3: (1.0, 1.0), 5: (1.0, 1.0)}
    with pytest.raises(ValueError, match="repeats=0"):
        time_decode_steps(model, [3], repeats=0)
