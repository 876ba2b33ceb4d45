"""Measurements on real runs: bytes per decode step as the context grows, per-rank pools, time split
(what `bench parallel`, `python -m moekv_ref.apps.parallel_run` and notebook 07 run and print).

    context_sweep_specs   one RunSpec per (KV placement, context): world_size sequences (one per
                          rank) prefilled to `context` tokens, then a few decode steps
    bytes_table           bytes per decode step from the Communicator's counters, summed over ranks,
                          split into attention (dispatch, combine, cached K/V, new K/V), FFN and
                          split sizes; with the measured compute / communication time split
    pool_table            per rank: blocks used and tokens held after every step

The model of the sweep is random (SWEEP_CONFIG): the embedded model's positions stop at 512.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..parallel.kv_placements import KV_PLACEMENTS
from ..parallel.programs import ModelSpec, RankResult, RunSpec, total_bytes
from ..placement import place_experts

# 2 layers, width 64, 8 attention experts (4 heads, 2 KV heads of 16) top-2, 8 FFN experts top-2
SWEEP_CONFIG = ModelConfig(
    name="sweep",
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    num_attention_experts=8,
    num_attention_experts_per_tok=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
)
ATTENTION_CATEGORIES = ("attention_dispatch", "attention_combine", "kv_context", "kv_new")
FFN_CATEGORIES = ("ffn_dispatch", "ffn_combine")


def expert_ranks(config: ModelConfig, world_size: int, strategy: str = "round_robin") -> tuple[tuple, tuple]:
    """(attention_ranks, ffn_ranks) as nested tuples, the same map for every layer (contiguous or
    round_robin; co-activation needs routing statistics: parallel/locality.py)."""
    attention = tuple(place_experts(config.num_attention_experts, world_size, strategy).tolist())
    ffn = tuple(place_experts(config.num_local_experts, world_size, strategy).tolist())
    return (attention,) * config.num_hidden_layers, (ffn,) * config.num_hidden_layers


def context_sweep_specs(
    world_size: int,
    contexts=(128, 512, 2048),
    placements=KV_PLACEMENTS,
    num_decode_steps: int = 2,
    config: ModelConfig = SWEEP_CONFIG,
    seed: int = 0,
    strategy: str = "round_robin",
    router_skew: float = 0.0,
    block_size: int = 16,
) -> list[RunSpec]:
    generator = torch.Generator().manual_seed(seed)
    attention, ffn = expert_ranks(config, world_size, strategy)
    specs = []
    for context in contexts:
        if context + num_decode_steps > config.max_position_embeddings:
            raise ValueError(
                f"context={context} + {num_decode_steps} decode steps is beyond "
                f"max_position_embeddings={config.max_position_embeddings}"
            )
        prompts = tuple(
            tuple(torch.randint(0, config.vocab_size, (context,), generator=generator).tolist())
            for _ in range(world_size)
        )
        decode = tuple(
            tuple(torch.randint(0, config.vocab_size, (num_decode_steps,), generator=generator).tolist())
            for _ in range(world_size)
        )
        # room for every sequence's whole cache on one rank, under any skew
        tokens = (
            world_size
            * (context + num_decode_steps)
            * config.num_hidden_layers
            * config.num_attention_experts_per_tok
        )
        num_blocks = (
            tokens // block_size + config.num_hidden_layers * config.num_attention_experts * world_size * 2
        )
        for placement in placements:
            specs.append(
                RunSpec(
                    ModelSpec(config.to_dict(), seed=seed, router_skew=router_skew),
                    placement,
                    attention,
                    ffn,
                    prompts,
                    decode,
                    num_blocks=num_blocks,
                    block_size=block_size,
                    record_logits=False,
                    label=f"{placement}@{context}",
                )
            )
    return specs


def bytes_table(spec: RunSpec, results: list[RankResult]) -> dict:
    """Mean bytes per decode step (steps 1..), summed over ranks, by group and category; weight bytes
    per rank; the measured split of a decode step into communication and the rest."""
    steps = list(range(1, spec.num_decode_steps + 1))
    categories: dict[str, float] = {}
    for step in steps:
        for category, value in total_bytes(results, step).items():
            categories[category] = categories.get(category, 0) + value / len(steps)
    attention = sum(categories.get(c, 0) for c in ATTENTION_CATEGORIES)
    ffn = sum(categories.get(c, 0) for c in FFN_CATEGORIES)
    step_seconds = max(sum(r.step_seconds[s] for s in steps) for r in results) / len(steps)
    comm_seconds = max(sum(r.comm_seconds.get(s, 0.0) for s in steps) for r in results) / len(steps)
    return {
        "kv_placement": spec.kv_placement,
        "context": len(spec.prompts[0]),
        "world_size": len(results),
        "bytes_per_decode_step": sum(categories.values()),
        "attention_bytes": attention,
        "ffn_bytes": ffn,
        "split_size_bytes": categories.get("split_sizes", 0),
        "by_category": categories,
        "weight_bytes_per_rank": [r.weight_bytes["total"] for r in results],
        "attention_weight_bytes_per_rank": [r.weight_bytes["attention_experts"] for r in results],
        "decode_step_ms": step_seconds * 1e3,
        "communication_ms": comm_seconds * 1e3,
    }


def pool_table(results: list[RankResult]) -> list[list[dict]]:
    """Per rank, per step: blocks used, tokens held, pool size."""
    return [[result.pool[step] for step in sorted(result.pool)] for result in results]
