"""Public entry points refuse what they cannot use with one ValueError naming the value and what is
allowed, where it is passed, not later inside a run with a raw TypeError, an IndexError or an
error about a value the caller never gave:

- RowPlacement (cache/rows.py) and the trace runner check their table of devices (shape (L, E),
  integers in [0, D)), their sizes and the sequence ids they are asked about;
- an unknown keyword names itself and the keywords allowed (never Python's TypeError, which names
  one and not what is allowed), the same form for every constructor and function;
- a value of the wrong type (a preset name, a checkpoint path, a callback) is named as such;
- generate(cache="paged") with a pool too small for its batch at its worst is refused before any
  token, naming num_blocks and the smallest pool that serves the batch.
"""

import re

import pytest
import torch
from helpers import random_model, small_config

from moekv_ref import ModelConfig, get_config
from moekv_ref.backends import require_backend
from moekv_ref.cache import KVCacheManager, PagedKVCache, RowPlacement
from moekv_ref.cache.block_pool import BlockPool
from moekv_ref.cache.budget import RowBudget
from moekv_ref.checkpoint import load_checkpoint, save_checkpoint
from moekv_ref.engine import LLMEngine, SchedulerConfig, generate_with_engine
from moekv_ref.generate import generate
from moekv_ref.placement import coactivation_counts, devices_touched, place_experts, place_layers
from moekv_ref.sampling import SamplingParams
from moekv_ref.sim.runner import RunnerSetup, TraceRunner
from moekv_ref.sim.traces import RoutingTrace
from moekv_ref.validation import check_device_table, check_keywords, known_keywords

MODEL = random_model(small_config("expert", "threshold"), seed=0)  # vocab 64, 96 positions, L=2, E=5, K=3
P4 = SamplingParams(max_new_tokens=4)
TABLE = torch.tensor([[0, 1, 1, 2], [2, 2, 0, 1]])  # (L, E) = (2, 4) over 3 devices
SELECTED = torch.tensor([[True, False, True, False], [False, True, False, True]])  # (N, E) = (2, 4)
ENGINE_KEYWORDS = "model, num_blocks, block_size, scheduler_config, num_swap_blocks, shuffle_seed, attention"


def hand_trace():
    """One layer, two experts, top-1; two sequences of 3 tokens, one on each expert."""
    routings = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int16).view(6, 1, 1)
    return RoutingTrace(routings, torch.tensor([0, 3, 6]), torch.tensor([1, 1]), 2, 1)


# (what is tried, the call, a fragment the error must contain)
PLACEMENT_CASES = [
    (
        "a float table",
        lambda: RowPlacement.by_expert(TABLE.float(), 3),
        "expert_devices[0, 0]=0.0 has dtype torch.float32; allowed: devices 0..2 as an integer tensor",
    ),
    (
        "a float entry of a list table",
        lambda: RowPlacement.by_expert([[0, 1.5]], 3),
        "expert_devices[0][1]=1.5 is a float; allowed: devices 0..2",
    ),
    (
        "a 3-layer table for 4 layers",
        lambda: RowPlacement(4, 4, 3, TABLE[:1].expand(3, -1)),
        "expert_devices must be (L, E) = (4, 4); got (3, 4)",
    ),
    (
        "a 1-D table",
        lambda: RowPlacement.by_expert(TABLE[0], 3),
        "expert_devices must be (L, E) with L, E >= 1; got (4,)",
    ),
    (
        "a device out of range",
        lambda: RowPlacement.by_expert(TABLE, 2),
        "expert_devices names devices [0, 1, 2]; allowed: 0..1 (num_devices=2)",
    ),
    (
        "a negative device",
        lambda: RowPlacement.by_expert(TABLE - 1, 3),
        "expert_devices names devices [-1, 0, 1]; allowed: 0..2",
    ),
    (
        "a table as text",
        lambda: RowPlacement.by_expert("0112", 3),
        "expert_devices='0112' is a str; allowed: devices 0..2",
    ),
    (
        "0 devices, by expert",
        lambda: RowPlacement.by_expert(TABLE, 0),
        "num_devices=0 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "0 devices, by sequence",
        lambda: RowPlacement.by_sequence(2, 4, 0),
        "num_devices=0 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "num_layers=-1",
        lambda: RowPlacement.by_sequence(-1, 4, 3),
        "num_layers=-1 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "num_experts=2.0",
        lambda: RowPlacement.by_sequence(2, 2.0, 3),
        "num_experts=2.0 is a float; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "sequence id 1.7",
        lambda: RowPlacement.by_expert(TABLE, 3).of_sequences([1.7]),
        "seq_ids[0]=1.7 is a float; allowed: integer ids",
    ),
    (
        "sequence id 'a'",
        lambda: RowPlacement.by_sequence(2, 4, 3).of_sequences(["a"]),
        "seq_ids[0]='a' is a str; allowed: integer ids",
    ),
    (
        "sequence ids as text",
        lambda: RowPlacement.by_sequence(2, 4, 3).of_sequences("a"),
        "seq_ids='a' is text (str)",
    ),
    (
        "a negative sequence id",
        lambda: RowPlacement.by_sequence(2, 4, 3).of_sequences([4, -2]),
        "seq_ids=[4, -2] is not allowed; allowed: sequence ids in [0, 2**63 - 1]",
    ),
    (
        "a negative sequence id in a tensor",
        lambda: RowPlacement.by_expert(TABLE, 3).of_sequences(torch.tensor([3, -1])),
        "seq_ids=[3, -1] is not allowed; allowed: sequence ids in [0, 2**63 - 1]",
    ),
    (
        "the trace runner with every expert on device -1",
        lambda: TraceRunner(
            hand_trace(), torch.tensor([-1, -1]), RunnerSetup(4, block_size=1), "newest_first", None
        ),
        "device_of_expert names devices [-1]; allowed: 0..536870910 (devices 0 up to the largest named "
        "get setup.blocks_per_device=4 blocks each, at most 2**31 - 1 in all)",
    ),
    (
        "the trace runner with a float table",
        lambda: TraceRunner(hand_trace(), torch.tensor([0.0, 1.0]), RunnerSetup(4), "newest_first", None),
        "device_of_expert[0]=0.0 has dtype torch.float32",
    ),
    (
        "the trace runner with a table of 3 experts for 2",
        lambda: TraceRunner(hand_trace(), torch.tensor([0, 1, 1]), RunnerSetup(4), "newest_first", None),
        "device_of_expert must be (E,) = (2,) or (L, E) = (1, 2); got (1, 3)",
    ),
    (
        "devices_touched with a device out of range",
        lambda: devices_touched(SELECTED, torch.tensor([0, 0, 1, 2]), 2),
        "device_of_expert names devices [0, 1, 2]; allowed: 0..1 (num_devices=2)",
    ),
    (
        "devices_touched with a placement of 3 experts for 4",
        lambda: devices_touched(SELECTED, torch.tensor([0, 0, 1]), 2),
        "device_of_expert must be (E,) = (4,) or (L, E) = (1, 4); got (1, 3)",
    ),
    (
        "coactivation_counts of 0/1 integers",
        lambda: coactivation_counts(SELECTED.int()),
        "selected is a torch.int32 tensor of shape (2, 4); allowed: a bool tensor (N, E)",
    ),
    (
        "place_experts with co-activation counts as lists",
        lambda: place_experts(4, 2, "coactivation", coactivation_counts(SELECTED).tolist()),
        "strategy='coactivation' needs an (4, 4) co-activation matrix",
    ),
    (
        "place_layers of no layer",
        lambda: place_layers([], 2, "contiguous"),
        "selected_per_layer=[] is a list; allowed: a non-empty list of bool tensors (..., E), one per layer",
    ),
]


@pytest.mark.parametrize("what,call,fragment", PLACEMENT_CASES, ids=[c[0] for c in PLACEMENT_CASES])
def test_a_placement_refuses_what_it_cannot_place(what, call, fragment):
    with pytest.raises(ValueError) as caught:
        call()
    assert fragment in str(caught.value)


def test_a_placement_takes_a_list_table_and_numpy_ids_as_a_tensor():
    """A table of lists (as KVCacheManager takes one) is the same placement as the tensor; the ids
    asked about may be any integers, a tensor of them included."""
    from_list = RowPlacement.by_expert(TABLE.tolist(), 3)
    assert torch.equal(from_list.expert_devices, TABLE) and from_list.expert_devices.dtype == torch.int64
    assert torch.equal(from_list.of_sequences(torch.tensor([0, 5]))[1], TABLE)
    assert RowPlacement.by_sequence(2, 4, 3).of_sequences(range(4))[:, 0, 0].tolist() == [0, 1, 2, 0]
    assert RowPlacement.by_sequence(2, 4, 3).of_sequences([]).shape == (0, 2, 4)


def test_check_device_table_reads_one_layer_for_every_layer_only_where_asked():
    assert check_device_table([0, 1], 2, 3, 2, every_layer=True).tolist() == [[0, 1]] * 3
    with pytest.raises(ValueError, match=r"must be \(L, E\) = \(3, 2\); got \(2,\)"):
        check_device_table([0, 1], 2, 3, 2)
    with pytest.raises(ValueError, match="not a rectangular table"):
        check_device_table([[0, 1], [0]], 2)


# ----- unknown keywords: one form everywhere ----------------------------------------------------------
KEYWORD_CASES = [
    (
        "get_config(bogus=1)",
        lambda: get_config("tiny", bogus=1),
        "unknown keyword bogus=1 for get_config('tiny'); allowed: name, vocab_size, hidden_size,",
    ),
    (
        "ModelConfig(bogus=1)",
        lambda: ModelConfig(bogus=1),
        "unknown keyword bogus=1 for ModelConfig; allowed: name, vocab_size, hidden_size,",
    ),
    (
        "SamplingParams(top_k=5)",
        lambda: SamplingParams(top_k=5),
        "unknown keyword top_k=5 for SamplingParams; allowed: max_new_tokens, temperature, top_p, seed",
    ),
    (
        "SamplingParams(top_k=5, min_p=0.1)",
        lambda: SamplingParams(top_k=5, min_p=0.1),
        "unknown keywords top_k=5, min_p=0.1 for SamplingParams",
    ),
    (
        "generate(colour='red')",
        lambda: generate(MODEL, [[1, 2]], P4, colour="red"),
        "unknown keyword colour='red' for generate; allowed: model, prompts, params, cache, record_logits, "
        "on_token, and for cache='paged' block_size, num_blocks, max_num_seqs, shuffle_seed, attention,",
    ),
    (
        "generate(cache='paged', colour='red')",
        lambda: generate(MODEL, [[1, 2]], P4, cache="paged", colour="red"),
        "unknown keyword colour='red' for generate",
    ),
    (
        "LLMEngine(backend='cuda')",
        lambda: LLMEngine(MODEL, backend="cuda"),
        f"unknown keyword backend='cuda' for LLMEngine; allowed: {ENGINE_KEYWORDS}",
    ),
    (
        "generate_with_engine(backend='cuda')",
        lambda: generate_with_engine(MODEL, [[1, 2]], P4, backend="cuda"),
        "unknown keyword backend='cuda' for generate_with_engine; allowed: model, prompts, params, block_size",
    ),
    (
        "PagedKVCache(backend='cuda')",
        lambda: PagedKVCache(MODEL.config, 64, backend="cuda"),
        "unknown keyword backend='cuda' for PagedKVCache; allowed: config, num_blocks, block_size, dtype",
    ),
    (
        "PagedKVCache.for_model(backend='cuda')",
        lambda: PagedKVCache.for_model(MODEL, backend="cuda"),
        "unknown keyword backend='cuda' for PagedKVCache.for_model; allowed: model, block_size, num_blocks",
    ),
    (
        "place_experts(stratgy='round_robin')",
        lambda: place_experts(8, 2, stratgy="round_robin"),
        "unknown keyword stratgy='round_robin' for place_experts; allowed: num_experts, num_devices, strategy, "
        "coactivation",
    ),
    (
        "KVCacheManager(num_block=8)",
        lambda: KVCacheManager(2, 4, 4, num_block=8),
        "unknown keyword num_block=8 for KVCacheManager; allowed: num_layers, num_experts, block_size, num_blocks",
    ),
    (
        "BlockPool(blocks=8)",
        lambda: BlockPool(blocks=8),
        "unknown keyword blocks=8 for BlockPool; allowed: num_blocks, shuffle_seed, blocks_per_device, options",
    ),
    (
        "SchedulerConfig(max_seqs=4)",
        lambda: SchedulerConfig(max_seqs=4),
        "unknown keyword max_seqs=4 for SchedulerConfig; allowed: max_num_seqs, max_num_batched_tokens,",
    ),
    (
        "RowBudget(32, sinks=2)",
        lambda: RowBudget(32, sinks=2),
        "unknown keyword sinks=2 for RowBudget; allowed: max_tokens, policy, num_sinks",
    ),
    (
        "load_checkpoint(device='cuda')",
        lambda: load_checkpoint(device="cuda"),
        "unknown keyword device='cuda' for load_checkpoint; allowed: path, config, dtype, backend",
    ),
]


@pytest.mark.parametrize("what,call,fragment", KEYWORD_CASES, ids=[c[0] for c in KEYWORD_CASES])
def test_an_unknown_keyword_is_named_with_the_allowed_ones(what, call, fragment):
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    assert fragment in str(caught.value)
    if "unknown keyword" in fragment:  # ours: a ValueError, as every refused value
        assert caught.type is ValueError


def test_known_keywords_keeps_the_signature_and_refuses_a_function_taking_any_keyword():
    import inspect

    assert list(inspect.signature(SamplingParams).parameters) == [
        "max_new_tokens",
        "temperature",
        "top_p",
        "seed",
    ]
    assert "backend" in inspect.signature(load_checkpoint).parameters
    assert SamplingParams(8, 0.0).max_new_tokens == 8  # positional arguments pass through
    with pytest.raises(TypeError, match="takes \\*\\*keywords"):
        known_keywords(lambda **anything: anything)
    with pytest.raises(
        ValueError, match=r"unknown keywords a=1, b=1, c=1, d=1, e=1, and 2 more for f; allowed: x"
    ):
        check_keywords("f", dict.fromkeys("abcdefg", 1), ("x",))


# ----- values of the wrong type -----------------------------------------------------------------------
TYPE_CASES = [
    (
        "get_config(['tiny'])",
        lambda: get_config(["tiny"]),
        "name=['tiny'] is a list; allowed: a preset name, one of ['deepseek-v3', 'jetmoe-8b', ",
    ),
    (
        "require_backend('cuda')",
        lambda: require_backend("cuda"),
        "backend='cuda' is not one of ('torch', 'triton')",
    ),
    (
        "load_checkpoint(backend='cuda') names the backend before it reads the file",
        lambda: load_checkpoint("no-such-checkpoint.pt", backend="cuda"),
        "backend='cuda' is not one of ('torch', 'triton')",
    ),
    (
        "load_checkpoint(123)",
        lambda: load_checkpoint(123),
        "path=123 is an int; allowed: a path, as a str or a pathlib.Path, or None",
    ),
    (
        "save_checkpoint(model, 123)",
        lambda: save_checkpoint(MODEL, 123),
        "path=123 is an int; allowed: a path, as a str or a pathlib.Path",
    ),
    (
        "generate_with_engine(on_token=5)",
        lambda: generate_with_engine(MODEL, [[1, 2]], P4, on_token=5),
        "on_token=5 is an int; allowed: a callable taking (prompt index, token), or None",
    ),
    (
        "generate(on_token='print')",
        lambda: generate(MODEL, [[1, 2]], P4, on_token="print"),
        "on_token='print' is a str; allowed: a callable taking (prompt index, token), or None",
    ),
]


@pytest.mark.parametrize("what,call,fragment", TYPE_CASES, ids=[c[0] for c in TYPE_CASES])
def test_a_value_of_the_wrong_type_is_named(what, call, fragment):
    with pytest.raises(ValueError) as caught:
        call()
    assert fragment in str(caught.value)


# ----- generate(cache="paged"): a pool too small for the batch is refused before any token ---------------
def smallest_pool(message: str) -> int:
    return int(re.search(r"allowed: num_blocks >= (\d+)", message).group(1))


def test_a_paged_generate_refuses_a_pool_its_batch_may_outgrow_and_names_the_smallest_that_serves_it():
    """Three prompts of 6 tokens + 20 new: 25 cached tokens each, held together to the end. At
    their worst (each token in 3 of 5 rows, 2 layers, blocks of 16) each layer of a sequence holds
    5 rows' first blocks and 70 // 16 = 4 full blocks more: 3 x 2 x 9 = 54 blocks. A pool of 8 once
    ran out mid-run with OutOfBlocksError; now it is refused before any token, and the smallest
    pool named serves the batch, one block less does not."""
    prompts = [[1, 2, 3, 4, 5, 6]] * 3
    params = SamplingParams(max_new_tokens=20)
    streamed = []
    with pytest.raises(ValueError) as caught:
        generate(
            MODEL, prompts, params, cache="paged", num_blocks=8, on_token=lambda i, t: streamed.append(t)
        )
    message = str(caught.value)
    assert message.startswith("num_blocks=8 is too small for this batch: generate holds its 3 sequences")
    assert smallest_pool(message) == 54 and streamed == []
    result = generate(MODEL, prompts, params, cache="paged", num_blocks=54)
    assert [len(t) for t in result.tokens] == [20, 20, 20]
    with pytest.raises(ValueError, match="num_blocks=53 is too small for this batch"):
        generate(MODEL, prompts, params, cache="paged", num_blocks=53)


def test_a_paged_generate_checks_each_devices_pool():
    """Per-device pools: device 0 holds experts 0, 1 (two rows of a token's three, at most), device
    1 experts 2, 3, 4 (all three); one prompt of 4 + 4 new tokens (7 cached, 2 blocks of 4 a row):
    device 0 may need 2 layers x 2 rows x 2 = 8 blocks, device 1 2 x 3 x 2 = 12."""
    placement = torch.tensor([0, 0, 1, 1, 1])
    options = dict(cache="paged", block_size=4, device_of_expert=placement)
    with pytest.raises(ValueError) as caught:
        generate(MODEL, [[1, 2, 3, 4]], P4, blocks_per_device=[4, 11], **options)
    assert str(caught.value).startswith(
        "blocks_per_device=[4, 11] is too small for this batch: generate holds its 1 sequence"
    )
    assert "allowed: blocks_per_device >= [8, 12] entry by entry" in str(caught.value)
    assert len(generate(MODEL, [[1, 2, 3, 4]], P4, blocks_per_device=[8, 12], **options).tokens[0]) == 4


def test_a_paged_generate_names_max_num_seqs_where_it_sized_the_pool():
    """Without num_blocks, max_num_seqs sizes the pool (that many sequences of max_position_embeddings
    = 8 tokens at their worst: 48 blocks of 1 each); three sequences of 7 cached tokens may need 3 x
    42 = 126, so max_num_seqs=1 is refused and the 3 it names serves them."""
    model = random_model(small_config("expert", "threshold", max_position_embeddings=8), seed=0)
    options = dict(cache="paged", block_size=1)
    with pytest.raises(ValueError) as caught:
        generate(model, [[1, 2, 3, 4]] * 3, P4, max_num_seqs=1, **options)
    assert str(caught.value).startswith("max_num_seqs=1 sizes a pool of 48 blocks, too small for this batch")
    assert "allowed: max_num_seqs >= 3, or num_blocks >= 126" in str(caught.value)
    assert len(generate(model, [[1, 2, 3, 4]] * 3, P4, max_num_seqs=3, **options).tokens) == 3
    with pytest.raises(ValueError, match="max_num_seqs=2 sizes a pool of 96 blocks"):
        generate(model, [[1, 2, 3, 4]] * 3, P4, max_num_seqs=2, **options)


def test_a_paged_generate_caps_each_rows_worst_case_at_its_budget():
    """With a row budget of 4 tokens a row never holds more than one block of 4: the batch of the test
    above, which may need 3 x 2 x (5 + 70 // 4) = 132 blocks of 4 without one, needs at most 3
    sequences x 2 layers x 5 rows = 30."""
    from moekv_ref.cache.budget import RowBudget

    prompts = [[1, 2, 3, 4, 5, 6]] * 3
    params = SamplingParams(max_new_tokens=20)
    options = dict(cache="paged", block_size=4, budget=RowBudget(4, "window"))
    with pytest.raises(ValueError) as caught:
        generate(MODEL, prompts, params, cache="paged", block_size=4, num_blocks=29)
    assert smallest_pool(str(caught.value)) == 132
    with pytest.raises(ValueError) as caught:
        generate(MODEL, prompts, params, num_blocks=29, **options)
    assert smallest_pool(str(caught.value)) == 30
    assert [len(t) for t in generate(MODEL, prompts, params, num_blocks=30, **options).tokens] == [20, 20, 20]


@pytest.mark.parametrize("seq_id", [1.7, "a", True, -1])
def test_a_manager_refuses_a_sequence_id_that_is_not_one_and_changes_nothing(seq_id):
    """add_sequence read int(1.7) as sequence 1, silently; now any id that is not a non-negative
    integer is refused, naming it, before a slot is taken."""
    manager = KVCacheManager(2, 4, 4, 16)
    with pytest.raises(ValueError, match="seq_id="):
        manager.add_sequence(seq_id)
    assert not manager.holds(1) and not manager.holds(0)
    slots = [manager.add_sequence(i) for i in range(2)]
    assert sorted(slots) == [0, 1]  # no slot was taken by the refused id
    manager.assert_consistent()
