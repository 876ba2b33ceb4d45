"""The serving engine under expert parallelism = the single-process engine, token for token.

One scheduler (rank 0) over a mirror of the ranks' pools, a device per rank: every KV placement at
2 ranks and kv_with_expert at 4
serve six ragged requests greedily, in float64, through pools small enough that a rank runs short;
the tokens must be the single-process engine's. The attention routers are skewed towards
low-numbered experts and experts are placed contiguously, so rank 0's pool fills first: the runs
must preempt at a step where another rank still had free blocks (one rank short, others not).
Every step, serve checks that the mirror's free blocks are what each rank reports (follow_ranks).
"""

import functools

import pytest
import torch
from helpers import random_prompts, small_config

from moekv_ref.apps.parallel_measure import expert_ranks
from moekv_ref.cache.kv_cache_manager import KVCacheManager
from moekv_ref.engine import LLMEngine
from moekv_ref.parallel.launcher import launch
from moekv_ref.parallel.programs import ModelSpec
from moekv_ref.parallel.serving import ServeSpec, follow_ranks, serve_specs
from moekv_ref.sampling import SamplingParams

CONFIG = small_config(
    num_attention_experts=8, num_attention_experts_per_tok=3, num_local_experts=4, num_experts_per_tok=2
)
MODEL = ModelSpec(CONFIG.to_dict(), seed=11, dtype="float64", router_skew=2.0)
PROMPTS = tuple(tuple(p) for p in random_prompts([3, 11, 6, 1, 17, 8], CONFIG.vocab_size, seed=5))
NEW_TOKENS = (12, 5, 20, 9, 7, 15)
CASES = [(2, "kv_with_expert"), (2, "kv_with_sequence"), (2, "replicated_attention"), (4, "kv_with_expert")]
_RUNS = {}


def spec(world_size, placement):
    attention, ffn = expert_ranks(CONFIG, world_size, "contiguous")
    return ServeSpec(
        MODEL,
        placement,
        attention,
        ffn,
        PROMPTS,
        NEW_TOKENS,
        num_blocks=60 if world_size == 2 else 40,
        block_size=4,
        max_num_seqs=6,
    )


def run(world_size, placement):
    if world_size not in _RUNS:
        mine = [p for w, p in CASES if w == world_size]
        results = launch(serve_specs, world_size, ([spec(world_size, p) for p in mine],))[0]
        _RUNS[world_size] = dict(zip(mine, results))
    return _RUNS[world_size][placement]


@functools.lru_cache(maxsize=1)
def single_process_tokens():
    engine = LLMEngine(MODEL.build(), num_blocks=2000, block_size=4)
    outputs = engine.generate(
        [list(p) for p in PROMPTS], [SamplingParams(max_new_tokens=n, temperature=0.0) for n in NEW_TOKENS]
    )
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("world_size,placement", CASES)
def test_parallel_engine_gives_single_process_tokens(world_size, placement):
    result = run(world_size, placement)
    assert result.tokens == single_process_tokens()
    # preempted because rank 0 was short while some other rank had at least a third of its pool free
    pool = spec(world_size, placement).num_blocks
    short_while_others_free = [
        step
        for step, kind, _ in result.events
        if kind == "preempted" and max(result.free_blocks[step][1:]) >= pool // 3
    ]
    assert result.num_preemptions >= 1 and short_while_others_free, result.events


def report(free_blocks, held):
    """A rank's report: [-1, free blocks, 0...], then [sequence id, its (L, E) tokens there]."""
    rows = [[-1, free_blocks] + [0] * (L * E - 1)] + [[seq_id] + counts for seq_id, counts in held]
    return torch.tensor(rows, dtype=torch.int64)


L, E = 1, 4


@pytest.mark.parametrize("home", [False, True])
def test_the_mirror_follows_the_ranks_and_a_drift_fails_loudly(home):
    """Experts 0, 1 on rank 0 and 2, 3 on rank 1 (or every row at its sequence's home), block size 2."""
    mirror = KVCacheManager(
        L,
        E,
        2,
        blocks_per_device=[10, 10],
        home_devices=home,
        device_of_expert=None if home else [0, 0, 1, 1],
    )
    if home:  # sequence 3's rows all on rank 1: 3 tokens in expert 0 and 1 in expert 2 take 3 blocks there
        reports = [report(10, []), report(7, [(3, [3, 0, 1, 0])])]
    else:  # rank 0: 3 tokens of expert 0 (2 blocks); rank 1: 1 token of expert 2 (1 block)
        reports = [report(8, [(3, [3, 0, 0, 0])]), report(9, [(3, [0, 0, 1, 0])])]
    assert follow_ranks(mirror, reports) == {3}
    assert mirror.token_counts([3]).tolist() == [[[3, 0, 1, 0]]]
    assert mirror.num_free_blocks_per_device.tolist() == [int(r[0, 1]) for r in reports]
    mirror.assert_consistent()  # every row's blocks on its device: its expert's rank, or its home
    reports[0][0, 1] -= 1  # rank 0 holds a block the mirror does not know of
    with pytest.raises(RuntimeError, match="mirror of the pools drifted: the ranks report"):
        follow_ranks(mirror, reports)
    reports[0][0, 1] += 1
    reports[1][1, 1 + (0 if home else 2)] -= 1  # a row of sequence 3 on rank 1 lost a token
    with pytest.raises(RuntimeError, match=r"drifted: rows of sequences \[3\] hold fewer tokens"):
        follow_ranks(mirror, reports)


@pytest.mark.parametrize(
    "option,value,allowed",
    [("admission", "predicted", "'optimistic' only"), ("preemption_mode", "swap", "'recompute' only")],
)
def test_the_parallel_engine_refuses_what_it_cannot_do(option, value, allowed):
    with pytest.raises(ValueError, match=f"{option}='{value}'.*{allowed}"):
        ServeSpec(MODEL, "kv_with_expert", (), (), PROMPTS, NEW_TOKENS, num_blocks=60, **{option: value})
