"""The serving engine: continuous batching, preemption, refusal.

Equivalence: under a pool of 25% of the unconstrained peak, with preemption by recompute and by swap,
every request finishes with exactly the tokens of generating it alone (greedy and sampled with its
seed), and no block is left in the pool or the swap space. Scenarios: the newest running request is
the one preempted; bad requests are refused before anything changes, and the others are still served.
Small random float64 models from helpers, so that a tie in argmax cannot flip between batchings.
"""

import pytest
import torch
from helpers import alone_tokens, random_model, random_prompts, random_workload, small_config

from moekv_ref.engine import LLMEngine, RequestStatus, SchedulerConfig, generate_with_engine
from moekv_ref.engine.workload import make_workload, run_workload
from moekv_ref.generate import generate
from moekv_ref.plots.serving import demand_table, pool_use, request_segments
from moekv_ref.sampling import SamplingParams

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model():
    return random_model(small_config("expert", "threshold"), seed=0)


@pytest.fixture(scope="module")
def workload():
    """16 requests, short prompts and longer outputs (so that decode growth, not admission, is what
    fills the pool), every other one greedy."""
    return random_workload(16, (2, 7), (10, 25), seed=0, prompt_seed=1)


@pytest.fixture(scope="module")
def alone(model, workload):
    return alone_tokens(model, *workload)


@pytest.fixture(scope="module")
def peak(model, workload, alone):
    """Blocks in use at the peak when every request runs at once in an unbounded pool."""
    engine = LLMEngine(
        model, num_blocks=4096, block_size=BLOCK_SIZE, scheduler_config=SchedulerConfig(max_num_seqs=64)
    )
    outputs = engine.generate(*workload)
    assert [o.token_ids for o in outputs] == alone
    assert engine.stats().max_concurrent_sequences == len(alone)
    return engine.stats().peak_used_blocks


def check_running_order(engine):
    """Replay the events: the victim of every preemption is the newest running request."""
    running = []
    for event in engine.events:
        if event.kind in ("admitted", "resumed"):
            running.append(event.request_id)
        elif event.kind == "finished":
            running.remove(event.request_id)
        elif event.kind == "preempted":
            assert running[-1] == event.request_id, (event, running)
            running.pop()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("admission", ["optimistic", "predicted"])
def test_quarter_pool_serves_everything_as_if_alone(model, workload, alone, peak, mode, admission):
    config = SchedulerConfig(preemption_mode=mode, admission=admission)
    engine = LLMEngine(
        model,
        num_blocks=peak // 4,
        block_size=BLOCK_SIZE,
        scheduler_config=config,
        shuffle_seed=3,
        record_history=True,
    )
    outputs = engine.generate(*workload)
    assert [o.token_ids for o in outputs] == alone
    assert all(r.status is RequestStatus.FINISHED for r in engine.requests.values())
    engine.memory.assert_no_leak()
    stats = engine.stats()
    assert stats.peak_used_blocks <= peak // 4
    use = pool_use(engine)  # the step's worst case was reserved before it ran
    assert (use["scheduled_used_blocks"] + use["reserved_blocks"] <= peak // 4).all()
    if admission == "optimistic":  # admitting on the next step alone must run short here
        assert stats.num_preemptions > 0 and stats.num_resumed == stats.num_preemptions
        if mode == "recompute":
            assert stats.num_recomputed_tokens > 0 and stats.num_swapped_out_blocks == 0
        else:
            assert stats.num_swapped_out_blocks > 0 and stats.num_recomputed_tokens == 0
    check_running_order(engine)


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full(model, workload, alone, peak):
    config = SchedulerConfig(preemption_mode="swap", admission="optimistic")
    engine = LLMEngine(
        model, num_blocks=peak // 4, block_size=BLOCK_SIZE, scheduler_config=config, num_swap_blocks=1
    )
    assert [o.token_ids for o in engine.generate(*workload)] == alone
    assert engine.stats().num_recomputed_tokens > 0
    engine.memory.assert_no_leak()


@pytest.mark.parametrize("policy", ["static", "continuous_reserved"])
def test_reserving_policies_never_preempt_and_give_the_same_tokens(model, workload, alone, peak, policy):
    engine = LLMEngine(
        model, num_blocks=peak // 2, block_size=BLOCK_SIZE, scheduler_config=SchedulerConfig(policy=policy)
    )
    assert [o.token_ids for o in engine.generate(*workload)] == alone
    assert engine.stats().num_preemptions == 0
    engine.memory.assert_no_leak()


def test_per_row_attention_gives_the_same_tokens(model, workload, alone):
    prompts, params = workload
    engine = LLMEngine(model, num_blocks=4096, block_size=BLOCK_SIZE, attention="reference")
    assert [o.token_ids for o in engine.generate(prompts[:4], params[:4])] == alone[:4]


def test_dense_attention_and_topk_routing_equal_alone():
    model = random_model(small_config("dense", "topk"), seed=1)
    prompts = random_prompts([3, 9, 5], 64, seed=2)
    params = [SamplingParams(max_new_tokens=8, temperature=0.7, seed=i) for i in range(3)]
    expected = [generate(model, [p], [q], cache="contiguous").tokens[0] for p, q in zip(prompts, params)]
    engine = LLMEngine(
        model,
        num_blocks=64,
        block_size=BLOCK_SIZE,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=4),
    )  # chunked prefill
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    engine.memory.assert_no_leak()


def test_a_request_that_cannot_fit_is_refused_and_the_others_are_served(model):
    engine = LLMEngine(model, num_blocks=40, block_size=BLOCK_SIZE, record_history=True)
    first = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0))
    with pytest.raises(ValueError, match=r"can never fit in the pool of 40 blocks.*the prompt alone"):
        engine.add_request([5] * 80, SamplingParams(max_new_tokens=10))
    # 20 + 10 - 1 = 29 cached tokens may take 2 layers x min(5 x 8, 5 + (87 - 5) // 4) = 50 blocks;
    # 22 tokens take at most 40, so at most 3 new tokens fit for sure
    with pytest.raises(ValueError, match="may not fit even alone.*max_new_tokens to at most 3,"):
        engine.add_request([5] * 20, SamplingParams(max_new_tokens=10))
    assert list(engine.requests) == [first] and len(engine.scheduler.waiting) == 1
    second = engine.add_request([4, 5], SamplingParams(max_new_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.requests[first].output_token_ids) == 5
    assert len(engine.requests[second].output_token_ids) == 4
    engine.memory.assert_no_leak()


@pytest.mark.parametrize(
    "params,match",
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ],
)
def test_invalid_sampling_params_are_refused_before_any_change(model, params, match):
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2], params)
    forced = SamplingParams(max_new_tokens=4)
    object.__setattr__(forced, next(iter(params)), next(iter(params.values())))  # bypass the frozen check
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2], forced)
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2], [3]], [SamplingParams(max_new_tokens=4), forced])
    assert not engine.requests and not engine.has_unfinished_requests() and not engine.events


@pytest.mark.parametrize("prompt,match", [([], "empty"), ([1, 64], "64"), ([1] * 90, "max_position")])
def test_bad_prompts_are_refused(model, prompt, match):
    engine = LLMEngine(model, num_blocks=4096, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, SamplingParams(max_new_tokens=10))
    assert not engine.requests


def test_timeline_segments_and_demand_table(model):
    workload = make_workload(
        6, prompt_len=(2, 8), output_len=(4, 12), arrival_rate=0.5, seed=4, vocab_size=64
    )
    engine = LLMEngine(
        model,
        num_blocks=48,
        block_size=BLOCK_SIZE,
        scheduler_config=SchedulerConfig(admission="optimistic"),
        record_history=True,
    )
    result = run_workload(engine, workload)
    assert len(result.outputs) == 6 and not result.refused
    segments = request_segments(engine)
    for rid, segs in segments.items():
        request = engine.requests[rid]
        assert segs[0][0] == request.arrival_step and segs[-1][1] == request.finished_step + 1
        assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))  # no gaps
        assert sum(end - start for start, end, state in segs if state == "running") >= 1
    use = pool_use(engine)
    assert len(use["step"]) == engine.step_count and use["used_blocks"].max() <= 48
    table = demand_table(engine)
    assert len(table) == 6 and all(r["actual_blocks"] > 0 for r in table)


def test_generate_with_engine_gives_the_static_batch_tokens(model, workload, alone):
    prompts, params = workload
    result = generate_with_engine(model, prompts[:5], params[:5], block_size=BLOCK_SIZE)
    assert result.options["engine"] and result.tokens == alone[:5]
    contiguous = generate(model, prompts[:5], params[:5], cache="contiguous")
    assert torch.equal(result.cache_counts, contiguous.cache_counts)
    streamed = []
    generate_with_engine(model, prompts[:2], params[:2], on_token=lambda i, t: streamed.append((i, t)))
    assert [t for i, t in streamed if i == 1] == alone[1]
