"""The serving engine under expert parallelism = the single-process engine, token for token.

One scheduler (rank 0) over per-rank pools: every KV placement at 2 ranks and kv_with_expert at 4
serve six ragged requests greedily, in float64, through pools small enough that a rank runs short;
the tokens must be the single-process engine's. The attention routers are skewed towards
low-numbered experts and experts are placed contiguously, so rank 0's pool fills first: the runs
must preempt at a step where another rank still had free blocks (one rank short, others not).
"""

import functools

import pytest
import torch

from moekv_ref.engine import LLMEngine
from moekv_ref.parallel.launcher import launch
from moekv_ref.parallel.measure import expert_ranks
from moekv_ref.parallel.programs import ModelSpec
from moekv_ref.parallel.serving import PerRank, ServeSpec, serve_specs
from moekv_ref.sampling import SamplingParams

from helpers import random_prompts, small_config

CONFIG = small_config(num_attention_experts=8, num_attention_experts_per_tok=3, num_local_experts=4,
                      num_experts_per_tok=2)
MODEL = ModelSpec(CONFIG.to_dict(), seed=11, dtype="float64", router_skew=2.0)
PROMPTS = tuple(tuple(p) for p in random_prompts([3, 11, 6, 1, 17, 8], CONFIG.vocab_size, seed=5))
NEW_TOKENS = (12, 5, 20, 9, 7, 15)
CASES = [(2, "kv_with_expert"), (2, "kv_with_sequence"), (2, "replicated_attention"), (4, "kv_with_expert")]
_RUNS = {}


def spec(world_size, placement):
    attention, ffn = expert_ranks(CONFIG, world_size, "contiguous")
    return ServeSpec(MODEL, placement, attention, ffn, PROMPTS, NEW_TOKENS, num_blocks=60 if world_size == 2 else 40,
                     block_size=4, max_num_seqs=6)


def run(world_size, placement):
    if world_size not in _RUNS:
        mine = [p for w, p in CASES if w == world_size]
        results = launch(serve_specs, world_size, ([spec(world_size, p) for p in mine],))[0]
        _RUNS[world_size] = dict(zip(mine, results))
    return _RUNS[world_size][placement]


@functools.lru_cache(maxsize=1)
def single_process_tokens():
    engine = LLMEngine(MODEL.build(), num_blocks=2000, block_size=4)
    outputs = engine.generate([list(p) for p in PROMPTS],
                              [SamplingParams(max_new_tokens=n, temperature=0.0) for n in NEW_TOKENS])
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("world_size,placement", CASES)
def test_parallel_engine_gives_single_process_tokens(world_size, placement):
    result = run(world_size, placement)
    assert result.tokens == single_process_tokens()
    # preempted because rank 0 was short while some other rank had at least a third of its pool free
    pool = spec(world_size, placement).num_blocks
    short_while_others_free = [step for step, kind, _ in result.events if kind == "preempted"
                               and max(result.free_blocks[step][1:]) >= pool // 3]
    assert result.num_preemptions >= 1 and short_while_others_free, result.events


def test_per_rank_comparisons():
    free = PerRank([3, 35])
    assert PerRank([4, 0]) > free          # rank 0 is short: does not fit
    assert not PerRank([3, 35]) > free
    assert PerRank([3, 1]) <= free
    assert 0 + PerRank([1, 2]) + PerRank([1, 1]) <= PerRank([2, 3])
    assert torch.equal((free - PerRank([1, 5])).values, torch.tensor([2, 30]))
