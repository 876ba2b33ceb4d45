"""Expert parallelism = one process (the parallel logits and tokens equal the single-process ones), on
real process groups.

World sizes 2 and 4 (gloo on CPU), every KV placement, float32 and float64: a ragged batch of five
prompts, prefilled in one step, then 32 decode steps with fixed tokens, must give the single-process
logits at every position (float32 within 1e-5, float64 within 1e-10). Every run of one world size
shares one launch (spawning processes is the slow part). The same runs check where K/V is kept, that
a token's hidden state travels once per rank, and that the byte counters agree with the cost model.
"""

import pytest
import torch
from helpers import random_prompts, small_config

from moekv_ref.config import ModelConfig
from moekv_ref.costs import measured_shape_bytes
from moekv_ref.parallel.kv_placements import KV_PLACEMENTS
from moekv_ref.parallel.programs import (
    ModelSpec,
    RunSpec,
    max_difference,
    merged_logits,
    reference_run,
    run_parallel,
    total_bytes,
    total_traffic,
)
from moekv_ref.placement import place_experts

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
NUM_DECODE_STEPS = 32
CONFIG = small_config(
    num_attention_experts=8, num_attention_experts_per_tok=3, num_local_experts=4, num_experts_per_tok=2
)
# expert placements differ between the world sizes so both strategies are exercised
EXPERT_PLACEMENT = {2: ("round_robin", "contiguous"), 4: ("contiguous", "round_robin")}


def make_specs(world_size: int) -> list[RunSpec]:
    prompts = tuple(tuple(p) for p in random_prompts([3, 11, 6, 1, 17], CONFIG.vocab_size, seed=5))
    generator = torch.Generator().manual_seed(6)
    decode = tuple(
        tuple(torch.randint(0, CONFIG.vocab_size, (NUM_DECODE_STEPS,), generator=generator).tolist())
        for _ in prompts
    )
    attention_strategy, ffn_strategy = EXPERT_PLACEMENT[world_size]
    L = CONFIG.num_hidden_layers
    attention = tuple(
        tuple(place_experts(CONFIG.num_attention_experts, world_size, attention_strategy).tolist())
        for _ in range(L)
    )
    ffn = tuple(
        tuple(place_experts(CONFIG.num_local_experts, world_size, ffn_strategy).tolist()) for _ in range(L)
    )
    specs = [
        RunSpec(
            ModelSpec(CONFIG.to_dict(), seed=11, dtype=dtype),
            placement,
            attention,
            ffn,
            prompts,
            decode,
            num_blocks=400,
            block_size=4,
            label=f"{placement}/{dtype}",
        )
        for placement in KV_PLACEMENTS
        for dtype in ("float32", "float64")
    ]
    if world_size == 2:  # a variable number of experts per token, too
        threshold = CONFIG.with_routing("threshold").to_dict()
        specs += [
            RunSpec(
                ModelSpec(threshold, seed=12, dtype="float64"),
                placement,
                attention,
                ffn,
                prompts,
                decode,
                num_blocks=400,
                block_size=4,
                label=f"{placement}/threshold",
            )
            for placement in ("kv_with_expert", "kv_with_sequence")
        ]
    return specs


_RUNS = {}
_REFERENCES = {}


def runs(world_size: int):
    """{label: (spec, rank results)} of one launch per world size, made on first use."""
    if world_size not in _RUNS:
        specs = make_specs(world_size)
        _RUNS[world_size] = {
            spec.label: (spec, results) for spec, results in zip(specs, run_parallel(specs, world_size))
        }
    return _RUNS[world_size]


CASES = [(w, f"{p}/{d}") for w in (2, 4) for p in KV_PLACEMENTS for d in ("float32", "float64")] + [
    (2, "kv_with_expert/threshold"),
    (2, "kv_with_sequence/threshold"),
]


@pytest.mark.parametrize("world_size,label", CASES)
def test_parallel_logits_equal_single_process(world_size, label):
    spec, results = runs(world_size)[label]
    # the single-process run depends on the model and the inputs only, not on the placement
    key = (repr(spec.model), spec.prompts, spec.decode_tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(spec)
    reference, reference_kv = _REFERENCES[key]
    parallel = merged_logits(results)
    assert len(parallel) == len(spec.prompts) * (NUM_DECODE_STEPS + 1)
    assert max_difference(parallel, reference) <= TOLERANCE[spec.model.dtype]
    # the K/V kept over all ranks is exactly the single process's, expert by expert
    kept = torch.stack([torch.tensor(r.kv_tokens_per_expert) for r in results]).sum(0)  # (L, E)
    assert kept.tolist() == reference_kv


@pytest.mark.parametrize("world_size", [2, 4])
def test_where_the_kv_lives(world_size):
    for label, (spec, results) in runs(world_size).items():
        ranks = torch.tensor(spec.attention_ranks)  # (L, E)
        for result in results:
            held = torch.tensor(result.kv_tokens_per_expert)  # (L, E)
            if spec.kv_placement == "kv_with_expert":  # only the experts placed on this rank
                assert (held[ranks != result.rank] == 0).all(), label
                assert held[ranks == result.rank].sum() > 0, label
            else:  # whole sequences: only its home sequences
                mine = [i for i in range(len(spec.prompts)) if i % world_size == result.rank]
                expected = sum(len(spec.prompts[i]) + NUM_DECODE_STEPS for i in mine)
                # every token sits in k of E experts of every layer (top-k routing)
                if "threshold" not in label:
                    assert (
                        int(held.sum())
                        == expected * CONFIG.num_hidden_layers * CONFIG.num_attention_experts_per_tok
                    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_attention_bytes_by_placement(world_size):
    for label, (spec, results) in runs(world_size).items():
        step = NUM_DECODE_STEPS  # the last decode step
        moved = total_bytes(results, step)
        attention = {c for c in moved if c.startswith(("attention", "kv_"))}
        if spec.kv_placement == "replicated_attention":
            assert attention == set(), label
        elif spec.kv_placement == "kv_with_expert":
            assert attention == {"attention_dispatch", "attention_combine"}, label
        else:
            assert attention == {"attention_dispatch", "attention_combine", "kv_context", "kv_new"}, label


def test_once_per_rank_dispatch_moves_fewer_hidden_states():
    # 8 experts on 2 ranks, top-3: every token has two experts on one rank (pigeonhole), so sending
    # once per rank must move strictly fewer hidden states than once per expert
    for label, (spec, results) in runs(2).items():
        if spec.kv_placement == "replicated_attention" or "threshold" in label:
            continue
        for step in range(NUM_DECODE_STEPS + 1):
            counts = total_traffic(results, step)
            assert counts["attention_pairs_to_peers"] < counts["attention_expert_pairs_to_peers"], label


@pytest.mark.parametrize("world_size", [2, 4])
def test_cost_model_bytes_equal_measured(world_size):
    for label, (spec, results) in runs(world_size).items():
        config = ModelConfig.from_dict(spec.model.config)
        for step in range(NUM_DECODE_STEPS + 1):
            measured = total_bytes(results, step)
            modelled = measured_shape_bytes(
                config,
                spec.kv_placement,
                world_size,
                total_traffic(results, step),
                bytes_per_value=4 if spec.model.dtype == "float32" else 8,
            )
            assert {c: b for c, b in modelled.items() if b} == measured, (label, step)


# Three ranks, each without some layer's attention or FFN experts, one (rank 2 in the second map) with
# no expert at all: a rank holding none of a layer's experts computes nothing for it, yet still
# sends its home tokens to the experts' ranks and joins every collective.
UNEVEN_PLACEMENTS = {
    "each rank short of a layer": (((0, 1, 0, 1, 0, 1, 0, 1), (2,) * 8), ((2, 2, 2, 2), (0, 1, 0, 1))),
    "rank 2 holds nothing": (((0, 1) * 4, (1, 0) * 4), ((0, 1, 0, 1), (1, 1, 0, 0))),
}


def test_a_rank_without_a_layer_s_experts_computes_nothing_for_it():
    prompts = tuple(tuple(p) for p in random_prompts([3, 7, 2, 5], CONFIG.vocab_size, seed=3))
    decode = tuple((1 + i, 9 + i, 17 + i) for i in range(len(prompts)))
    specs = [
        RunSpec(
            ModelSpec(CONFIG.to_dict(), seed=11, dtype="float64"),
            placement,
            attention,
            ffn,
            prompts,
            decode,
            num_blocks=64,
            block_size=4,
            label=f"{name}/{placement}",
        )
        for name, (attention, ffn) in UNEVEN_PLACEMENTS.items()
        for placement in KV_PLACEMENTS
    ]
    reference, reference_kv = reference_run(specs[0])
    for spec, results in zip(specs, run_parallel(specs, 3, timeout_s=10.0)):
        assert max_difference(merged_logits(results), reference) <= TOLERANCE["float64"], spec.label
        kept = torch.stack([torch.tensor(r.kv_tokens_per_expert) for r in results]).sum(0)
        assert kept.tolist() == reference_kv, spec.label
