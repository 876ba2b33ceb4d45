"""The exercises at the end of the notebooks: each asks the reader for one small answer, and its
`check_*` function says whether it is right and, when it is not, *why* -- naming the usual mistake
the answer matches. The solutions are here too (`solution_*`), computed by the same package code the
notebooks teach, so a check can never disagree with the lesson.

    01  predict the recompute / cached FLOP ratio of one decode step at a context length
    02  compute one expert's cache size, in bytes, from the router's decisions
    03  choose the largest block size that keeps plain pages at effective utilization >= 0.96
    04  choose max_num_seqs so that optimistic admission never preempts, as fast as possible
    05  write a victim rule: preempt the request that makes the most room on the short device
    06  count the prompt tokens a prefix hit reuses, in whole blocks
    07  place experts on ranks: few ranks touched per token, K/V balanced over the ranks
    08  choose the split size of split-K decode attention that keeps every SM of a GPU busy
    09  the price of routing attention, as a ratio of perplexities
    10  find the smallest row budget at which drop refuses no token of a snippet
    11  count the blocks worst-case reservation sets aside for a prompt on each GPU of a cluster

Every check returns a message starting with "Right" or "Not yet" (or "No answer yet" for the
placeholder the notebooks are saved with), so a notebook cell just prints it.
"""

from __future__ import annotations

import functools
import textwrap
from functools import lru_cache
from itertools import combinations

import torch

from .analysis import decode_flops, heldout_text
from .apps.bench_cluster import BLOCK_SIZE, MODEL, cluster_placement, pool_blocks
from .apps.bench_eviction import skewed_workload, workload_cost_model
from .apps.demo import demo_workload, serve, summarize
from .cache import PagedKVCache
from .cache.budget import RowBudget
from .cache.rows import ceil_div
from .checkpoint import load_default_model
from .config import get_config
from .costs import GPUS
from .engine import LLMEngine, SchedulerConfig
from .engine.request import Request, RequestStatus
from .engine.victims import Shortage, VictimPolicy, room_and_lost_work
from .engine.workload import few_shot_workload
from .placement import coactivation_counts, devices_touched, place_experts
from .prompts import encode
from .sampling import SamplingParams
from .sim.designs import CountingPagedDesign
from .sim.eviction import EvictionSetup, TraceRunner, simulate
from .sim.replay import replay
from .sim.traces import RoutingTrace, synthetic_trace, topic_trace
from .validation import is_integer

RIGHT, WRONG, MISSING = "Right", "Not yet", "No answer yet"


def _wrapped(check):
    """Checks return one paragraph; wrap it at 100 columns so that it reads at notebook width."""

    @functools.wraps(check)
    def wrapped(*args, **kwargs):
        return textwrap.fill(check(*args, **kwargs), width=100)

    return wrapped


def _close(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * abs(target)


# ---------------------------------------------------------------------------------------------------
# 01: how much work the cache saves


EXERCISE_01_CONTEXT_LENGTH = 384
FLOP_RATIO_TOLERANCE = (
    0.03  # relative: the ratio sits 5% under t + 1 at t = 384, so a looser band would pass t + 1
)


def solution_flop_ratio(config, context_length: int = EXERCISE_01_CONTEXT_LENGTH) -> float:
    """Recompute FLOPs / cached FLOPs of one decode step after `context_length` tokens."""
    return decode_flops(config, context_length, cached=False) / decode_flops(
        config, context_length, cached=True
    )


@_wrapped
def check_flop_ratio(answer, config, context_length: int = EXERCISE_01_CONTEXT_LENGTH) -> str:
    """Is `answer` within 3% of the recompute / cached FLOP ratio at `context_length`?"""
    if answer is None:
        return (
            f"{MISSING}: replace None with your prediction of recompute / cached FLOPs at "
            f"t = {context_length}. Hint: recompute runs all t + 1 tokens through every layer; the "
            f"cached step runs one, and reads t * k / E cached keys per expert."
        )
    answer = float(answer)
    right = solution_flop_ratio(config, context_length)
    tokens = context_length + 1
    if _close(answer, right, FLOP_RATIO_TOLERANCE):
        return (
            f"{RIGHT}: the ratio is {right:.0f}x (you said {answer:.0f}). It is a little under "
            f"t + 1 = {tokens}: recompute does the per-token work (projections, FFN, output head) "
            f"for all {tokens} tokens, the cached step for one, and the attention the cached step "
            f"still pays over its t * k / E cached keys per expert keeps the ratio below t + 1."
        )
    if answer > 0 and _close(1 / answer, right, FLOP_RATIO_TOLERANCE):
        return (
            f"{WRONG}: {answer:.4f} is cached / recompute, the inverse. The ratio asked for is "
            f"recompute / cached, which is far above 1."
        )
    if _close(answer, tokens**2, 0.25) or answer > 4 * right:
        return (
            f"{WRONG}: {answer:.0f} is far too large. Only the attention "
            f"scores grow quadratically under recompute; at this model's size most of the work is "
            f"the per-token projections and FFN, which grow linearly, so the ratio is close to "
            f"t + 1 = {tokens}, not (t + 1)^2."
        )
    if _close(answer, tokens, 0.02):
        return (
            f"{WRONG}: {answer:.0f} = t + 1 is the ratio if the cached step cost nothing but its one "
            f"token. It also scores its query against t * k / E cached keys per expert in every layer, "
            f"work that recompute's per-token count does not cover: estimate what that attention adds "
            f"to the cached step, as a share of its per-token work, and lower t + 1 by that share."
        )
    direction = "too low" if answer < right else "too high"
    distance = (
        "within 10%, but outside the 3% the check accepts"
        if _close(answer, right, 0.1)
        else "by more than 10%"
    )
    return (
        f"{WRONG}: {answer:.0f} is {direction}, {distance}. Recompute pays for all t + 1 = {tokens} "
        f"tokens in every layer; the cached step for one token plus attention over its cache. Count "
        f"both per layer from the description in section 2."
    )


# ---------------------------------------------------------------------------------------------------
# 02: one expert's cache, from the routing decisions


EXERCISE_02_PROMPT = "class Cache:\n    def __init__(self, size):"
EXERCISE_02_LAYER = 2
EXERCISE_02_EXPERT = 5
EXERCISE_02_BYTES_PER_VALUE = 4  # float32


def solution_expert_cache_bytes(
    selected,
    config,
    layer: int = EXERCISE_02_LAYER,
    expert: int = EXERCISE_02_EXPERT,
    bytes_per_value: int = EXERCISE_02_BYTES_PER_VALUE,
) -> int:
    """Bytes held by (layer, expert)'s cache after a prompt: the tokens routed to the expert, times
    K and V (2) x key/value heads x head dim x bytes per value. `selected`: one (T, E) bool tensor per
    layer, as `moekv_ref.analysis.route_prompt` returns."""
    tokens = int(selected[layer][:, expert].sum())
    return tokens * 2 * config.num_key_value_heads * config.head_dim * bytes_per_value


@_wrapped
def check_expert_cache_bytes(
    answer,
    selected,
    config,
    layer: int = EXERCISE_02_LAYER,
    expert: int = EXERCISE_02_EXPERT,
    bytes_per_value: int = EXERCISE_02_BYTES_PER_VALUE,
) -> str:
    """Is `answer` the number of bytes (layer, expert)'s cache holds? Names the usual mistakes."""
    if answer is None:
        return (
            f"{MISSING}: replace None with the bytes that expert {expert} of layer {layer} holds. "
            f"Hint: count the tokens routed to it (a column of selected[{layer}]), then multiply by "
            f"the bytes one token takes in one expert's cache."
        )
    answer = int(answer)
    num_tokens, num_experts = selected[layer].shape
    tokens = int(selected[layer][:, expert].sum())
    per_value = config.num_key_value_heads * config.head_dim  # one of K or V, one token
    per_token = 2 * per_value * bytes_per_value
    right = tokens * per_token
    if answer == right:
        return (
            f"{RIGHT}: {tokens} of the {num_tokens} tokens chose expert {expert} in layer {layer}, "
            f"and each takes 2 (K and V) x {config.num_key_value_heads} heads x {config.head_dim} "
            f"dims x {bytes_per_value} bytes = {per_token} bytes: {right} bytes."
        )
    if answer == tokens:
        return (
            f"{WRONG}: {answer} is the token count, not bytes. Multiply it by the bytes one token "
            f"takes in one expert's cache: section 2 says what a cached token stores, and a float32 "
            f"value takes {bytes_per_value} bytes."
        )
    if answer == tokens * per_value * bytes_per_value:  # also what K and V in 2-byte values give
        return (
            f"{WRONG}: your count leaves out part of each token's entry: did you count K only (the "
            f"cache keeps K and V), or 2 bytes per value (the model here runs in float32: "
            f"{bytes_per_value} bytes per value)?"
        )
    if answer == num_tokens * per_token:
        return (
            f"{WRONG}: that counts all {num_tokens} tokens of the prompt. A token is stored only by "
            f"the experts its router chose: count only the tokens that chose expert {expert}."
        )
    total_in_layer = int(selected[layer].sum())
    if answer == total_in_layer * per_token:
        return (
            f"{WRONG}: that is the whole layer's cache ({total_in_layer} entries over all "
            f"{num_experts} experts); the question is about expert {expert} alone."
        )
    average = total_in_layer / num_experts
    if abs(answer - average * per_token) < per_token:
        return (
            f"{WRONG}: that is the average expert ({average:.1f} tokens). Routing is skewed, so "
            f"expert {expert} holds a different number: count its column of the routing matrix."
        )
    for other in range(len(selected)):
        if other != layer and answer == int(selected[other][:, expert].sum()) * per_token:
            return (
                f"{WRONG}: that is expert {expert} of layer {other}; every layer routes on its own, "
                f"and the question is about layer {layer}."
            )
    for other in range(num_experts):
        if other != expert and answer == int(selected[layer][:, other].sum()) * per_token:
            return (
                f"{WRONG}: that is expert {other}'s cache; experts are numbered from 0 (e0 is the first row)."
            )
    return (
        f"{WRONG}: {answer} bytes is not it. Count the tokens in column {expert} of selected[{layer}] "
        f"and multiply by {per_token} bytes per token."
    )


# ---------------------------------------------------------------------------------------------------
# 03: a block size for a workload


EXERCISE_03_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
TARGET_EFFECTIVE_UTILIZATION = 0.96


def exercise_03_workload() -> RoutingTrace:
    """The first 8 sequences of bench memory's W3 (E = 8, top-2, 16 layers, prompt and output lengths
    log-normal of mean 256 each, Zipf(1) expert popularity), built here so that the exercise does not
    change if the benchmark's workloads do."""
    return synthetic_trace(
        8,
        num_layers=16,
        num_experts=8,
        top_k=2,
        mean_prompt=256,
        mean_output=256,
        zipf_s=1.0,
        seed=3,
        name="W3",
    )


@lru_cache(maxsize=None)
def _exercise_03_utilization(block_size: int) -> float:
    trace = exercise_03_workload()
    design = CountingPagedDesign(trace.num_sequences, trace.num_layers, trace.num_experts, block_size)
    return replay(trace, design).effective_utilization


def solution_block_size() -> int:
    """The largest block size in EXERCISE_03_BLOCK_SIZES at which plain pages keep effective
    utilization >= 0.96 on the exercise's workload."""
    return max(
        P for P in EXERCISE_03_BLOCK_SIZES if _exercise_03_utilization(P) >= TARGET_EFFECTIVE_UTILIZATION
    )


@_wrapped
def check_block_size(answer) -> str:
    """Is `answer` the largest block size reaching effective utilization >= 0.96 on the workload?"""
    if answer is None:
        return (
            f"{MISSING}: replace None with a block size from {EXERCISE_03_BLOCK_SIZES}. Hint: a row "
            f"wastes on average about half a block; estimate the tokens per row first."
        )
    if answer not in EXERCISE_03_BLOCK_SIZES:
        return f"{WRONG}: {answer!r} is not one of the block sizes offered, {EXERCISE_03_BLOCK_SIZES}."
    trace = exercise_03_workload()
    tokens_per_row = float(trace.lengths.double().mean()) * trace.experts.shape[2] / trace.num_experts
    mine = _exercise_03_utilization(answer)
    right = solution_block_size()
    if answer == right:
        larger = EXERCISE_03_BLOCK_SIZES[EXERCISE_03_BLOCK_SIZES.index(right) + 1]
        return (
            f"{RIGHT}: P = {right} keeps effective utilization at {mine:.3f}; P = {larger} drops to "
            f"{_exercise_03_utilization(larger):.3f}. Rows end holding about {tokens_per_row:.0f} "
            f"tokens and waste about half a block each, and larger blocks would mean fewer, longer "
            f"reads per decode token, so the largest block that meets the target is the one to take."
        )
    if mine < TARGET_EFFECTIVE_UTILIZATION:
        return (
            f"{WRONG}: at P = {answer} effective utilization is {mine:.3f} < "
            f"{TARGET_EFFECTIVE_UTILIZATION}. Each row wastes about P/2 slots of its last block, "
            f"and rows here end near {tokens_per_row:.0f} tokens (fewer early in the run), so that "
            f"waste is too large a share: try smaller blocks."
        )
    return (
        f"{WRONG}: P = {answer} reaches {mine:.3f}, but a larger block size also stays >= "
        f"{TARGET_EFFECTIVE_UTILIZATION}; larger blocks mean fewer block-table entries and fewer, "
        f"longer reads per decode token, so take the largest that meets the target."
    )


# ---------------------------------------------------------------------------------------------------
# 04: how many sequences to run at once under optimistic admission


EXERCISE_04_MAX_NUM_SEQS = (1, 2, 3, 4, 6, 8, 16)
EXERCISE_04_NUM_REQUESTS = 12
EXERCISE_04_NUM_BLOCKS = 200


def exercise_04_workload():
    """Twelve requests of the demo workload (notebook 04's widget runs the same ones), without the
    oversized request: arrivals 0.5 per step, prompts of 16-160 bytes, outputs of 16-128 tokens."""
    return demo_workload(EXERCISE_04_NUM_REQUESTS, arrival_rate=0.5, seed=0, with_oversized=False)


@lru_cache(maxsize=None)
def _exercise_04_run(max_num_seqs: int) -> dict:
    """One serving run: optimistic admission, preemption by recompute, a pool of 200 blocks of 16."""
    engine, result = serve(
        load_default_model("threshold"),
        exercise_04_workload(),
        EXERCISE_04_NUM_BLOCKS,
        admission="optimistic",
        preemption_mode="recompute",
        max_num_seqs=max_num_seqs,
    )
    summary = summarize(engine, result)
    return {
        key: summary[key] for key in ("steps", "preempted", "recomputed_tokens", "max_concurrent_sequences")
    }


def solution_max_num_seqs() -> int:
    """The largest max_num_seqs in EXERCISE_04_MAX_NUM_SEQS such that it, and every smaller choice,
    serves the exercise's workload without one preemption (runs the engine: tens of seconds)."""
    best = None
    for max_num_seqs in EXERCISE_04_MAX_NUM_SEQS:
        if _exercise_04_run(max_num_seqs)["preempted"]:
            break
        best = max_num_seqs
    return best


@_wrapped
def check_max_num_seqs(answer) -> str:
    """Is `answer` the largest max_num_seqs at which optimistic admission never preempts? Runs the
    engine at the answer and at the next larger choice."""
    if answer is None:
        return (
            f"{MISSING}: replace None with a max_num_seqs from {EXERCISE_04_MAX_NUM_SEQS}. Hint: "
            f"optimistic admission lets a request in whenever its next step fits; what stops the "
            f"pool from running short later is how many sequences grow in it at once."
        )
    if answer not in EXERCISE_04_MAX_NUM_SEQS:
        return f"{WRONG}: {answer!r} is not one of the choices offered, {EXERCISE_04_MAX_NUM_SEQS}."
    mine = _exercise_04_run(answer)
    if mine["preempted"]:
        return (
            f"{WRONG}: at max_num_seqs = {answer} the engine preempted {mine['preempted']} time(s) and "
            f"recomputed {mine['recomputed_tokens']} tokens: with up to {mine['max_concurrent_sequences']} "
            f"sequences admitted on their next step alone, their decode growth outran the "
            f"{EXERCISE_04_NUM_BLOCKS}-block pool. Allow fewer sequences at once."
        )
    index = EXERCISE_04_MAX_NUM_SEQS.index(answer)
    if index + 1 == len(EXERCISE_04_MAX_NUM_SEQS):
        return (
            f"{RIGHT}: even {answer} sequences at once never preempt ({mine['steps']} steps); the pool "
            f"holds everything this workload runs at once."
        )
    larger = EXERCISE_04_MAX_NUM_SEQS[index + 1]
    next_run = _exercise_04_run(larger)
    if next_run["preempted"]:
        return (
            f"{RIGHT}: max_num_seqs = {answer} serves the {EXERCISE_04_NUM_REQUESTS} requests in "
            f"{mine['steps']} steps without "
            f"a preemption; {larger} lets in one sequence too many, which the pool cannot keep as it "
            f"grows: {next_run['preempted']} preemption(s), {next_run['recomputed_tokens']} tokens "
            f"recomputed. A cap on running sequences is a crude prediction of demand: the right cap "
            f"depends on the requests' lengths and the pool, so it must be found again for every "
            f"workload; predicted admission adapts by itself."
        )
    return (
        f"{WRONG}: max_num_seqs = {answer} never preempts, but neither does the next choice up, which "
        f"finishes in {next_run['steps']} steps instead of {mine['steps']}: more sequences per step is "
        f"faster as long as the pool holds them. Take a larger value."
    )


# ---------------------------------------------------------------------------------------------------
# 05: a victim rule for per-device pools


def exercise_05_setup():
    """(trace, device_of_expert, setup, cost): notebook 05's widget workload (20 sequences of 32 prompt
    and 128 output tokens on average, 4 layers, 16 experts on 4 devices placed by co-activation, topic
    skew 1.5), 160 blocks of 16 per device, recompute only."""
    trace, _, placement = skewed_workload(
        num_sequences=20, num_layers=4, num_devices=4, mean_prompt=32, mean_output=128, topic_s=1.5, seed=0
    )
    setup = EvictionSetup(blocks_per_device=160, block_size=16, max_num_seqs=16)
    return trace, placement, setup, workload_cost_model(trace, setup.block_size)


def room_on_short_device(order: int, request, memory, need) -> int:
    """Blocks preempting candidates[order] makes free on the short device (need.device): those it
    holds there, plus, for the request being scheduled (order 0), what its step would take there
    (need.request_need)."""
    return room_and_lost_work(order, request, memory, need)[0]


def solution_victim_rule(candidates, memory, need):
    """Preempt the candidate that makes the most room on the short device (ties: the newest)."""
    return max(enumerate(candidates), key=lambda item: (room_on_short_device(*item, memory, need), item[0]))[
        1
    ]


def _run_victim_rule(choose) -> tuple:
    """Run the rule as the scheduler's victim policy over the exercise's trace; returns (stats,
    decisions, error). Each decision is (short device, [(request id, order, blocks there, step blocks
    there, blocks everywhere)], chosen request id)."""
    decisions = []

    class ReaderRule(VictimPolicy):
        name = "your rule"

        def choose_victim(self, candidates, memory, need):
            choice = choose(list(candidates), memory, need)
            if not any(choice is c for c in candidates):
                raise ValueError(f"the rule returned {choice!r}; return one of the candidates given to it")
            entries = []
            for order, request in enumerate(candidates):
                held = memory.blocks_held_per_device(request.request_id)  # (D,)
                entries.append(
                    (
                        request.request_id,
                        order,
                        int(held[need.device]),
                        need.request_need if order == 0 else 0,
                        int(held.sum()),
                    )
                )
            decisions.append((need.device, entries, choice.request_id))
            return choice

    trace, placement, setup, cost = exercise_05_setup()
    try:
        stats = simulate(trace, placement, setup, ReaderRule(), cost)
    except Exception as error:  # the reader's code: report it, do not crash the notebook
        return None, decisions, error
    return stats, decisions, None


# Shortages the run rarely meets, put to the rule by hand: on the exercise's workload the request
# being scheduled seldom needs enough blocks for its own step to change the choice, and the request
# holding most on the short device usually holds most everywhere too. Each: (short device, request
# need, [blocks held per device of each candidate, oldest first]).
EXERCISE_05_SHORTAGES = (
    # the request being scheduled (2 held + 5 for its step) makes more room than request 101 (6 held);
    # request 102 holds most over every device but little on the short one
    (1, 5, [[0, 2, 1, 0], [1, 6, 0, 1], [9, 1, 8, 3]]),
    # request 101 holds most on the short device; request 102 holds most over every device
    (2, 0, [[1, 0, 1, 1], [0, 1, 4, 0], [5, 1, 2, 4]]),
)


class _ShortageMemory:
    """The part of the scheduler's MemoryView a victim rule reads, for a hand-built shortage."""

    has_swap_space = False

    def __init__(self, held: dict[int, list[int]]):
        self._held = {request_id: torch.tensor(blocks) for request_id, blocks in held.items()}
        self.num_devices = len(next(iter(held.values())))

    def blocks_held_per_device(self, request_id: int) -> torch.Tensor:
        return self._held[request_id].clone()


def _victim_rule_on_shortages(choose) -> list:
    """The rule's decisions on EXERCISE_05_SHORTAGES, in _run_victim_rule's format."""
    decisions = []
    for device, request_need, held in EXERCISE_05_SHORTAGES:
        candidates = [
            Request(
                100 + order,
                [0] * 16,
                SamplingParams(max_new_tokens=16),
                status=RequestStatus.RUNNING,
                num_computed_tokens=16 * sum(blocks),
            )
            for order, blocks in enumerate(held)
        ]
        memory = _ShortageMemory({r.request_id: blocks for r, blocks in zip(candidates, held)})
        need = Shortage(device, 1, request_need)
        choice = choose(list(candidates), memory, need)
        if not any(choice is c for c in candidates):
            raise ValueError(f"the rule returned {choice!r}; return one of the candidates given to it")
        entries = [
            (r.request_id, order, blocks[device], request_need if order == 0 else 0, sum(blocks))
            for order, (r, blocks) in enumerate(zip(candidates, held))
        ]
        decisions.append((device, entries, choice.request_id))
    return decisions


@lru_cache(maxsize=None)
def _exercise_05_baseline():
    trace, placement, setup, cost = exercise_05_setup()
    return simulate(trace, placement, setup, "sequence_lru", cost)


@_wrapped
def check_victim_rule(choose) -> str:
    """Does `choose(candidates, memory, need)` always preempt a request making the most room on the
    short device? Runs it as the scheduler's victim policy over a trace, puts it to the hand-built
    EXERCISE_05_SHORTAGES (where the usual mistakes choose differently), and checks every decision;
    names the usual mistakes."""
    if choose is None:
        return (
            f"{MISSING}: replace None with your function choose(candidates, memory, need) that returns "
            f"one of the candidates. Hint: memory.blocks_held_per_device(r.request_id)[need.device] is "
            f"what request r holds on the short device; the first candidate's step would also take "
            f"need.request_need blocks there."
        )
    if not callable(choose):
        return f"{WRONG}: {choose!r} is not a function; write def choose(candidates, memory, need): ..."
    stats, decisions, error = _run_victim_rule(choose)
    num_run = len(decisions)
    if error is None:
        try:
            decisions += _victim_rule_on_shortages(choose)
        except Exception as raised:  # the reader's code: report it, do not crash the notebook
            error = raised
    if error is not None:
        return f"{WRONG}: the run stopped with an error from your rule: {type(error).__name__}: {error}"
    if not decisions:
        return (
            f"{WRONG}: the workload needed no eviction, so the rule was never asked (this should not happen)."
        )

    def room(entry):
        return entry[2] + entry[3]

    missed = []
    for index, (device, entries, chosen) in enumerate(decisions):
        chosen_entry = next(e for e in entries if e[0] == chosen)
        if room(chosen_entry) < max(room(e) for e in entries):
            missed.append((device, entries, chosen_entry, index >= num_run))
    base = _exercise_05_baseline()
    if not missed:
        return (
            f"{RIGHT}: every one of the {len(decisions)} decisions ({num_run} in the run, "
            f"{len(decisions) - num_run} on shortages built by hand) took a request making the most room "
            f"on the short device. Over the run it freed {stats.freed_per_eviction:.1f} blocks there per "
            f"eviction ({stats.num_evictions} evictions, {stats.recomputed_tokens} tokens recomputed, "
            f"{stats.num_steps} steps) where sequence_lru, which takes the newest request wherever its "
            f"blocks are, freed {base.freed_per_eviction:.1f} ({base.num_evictions} evictions, "
            f"{base.num_steps} steps). pressure_aware also divides the room by what the eviction costs."
        )
    device, entries, chosen_entry, by_hand = missed[0]
    best = max(entries, key=room)
    newest = all(chosen == max(entries, key=lambda e: e[1])[0] for _, entries, chosen in decisions)
    held_only = all(
        next(e for e in entries if e[0] == chosen)[2] == max(e[2] for e in entries)
        for _, entries, chosen in decisions
    )
    everywhere = all(
        next(e for e in entries if e[0] == chosen)[4] == max(e[4] for e in entries)
        for _, entries, chosen in decisions
    )
    lowest = all(
        room(next(e for e in entries if e[0] == chosen)) == min(room(e) for e in entries)
        for _, entries, chosen in decisions
    )
    first = "a shortage the check builds by hand" if by_hand else "one of the run"
    where = (
        f"In {len(missed)} of {len(decisions)} decisions ({num_run} in the run, "
        f"{len(decisions) - num_run} on shortages built by hand) it did not take the request making "
        f"the most room; the first, {first}: device {device} was short and you took request "
        f"{chosen_entry[0]}, which makes {room(chosen_entry)} block(s) of room there, while request "
        f"{best[0]} would have made {room(best)}."
    )
    if newest:
        return (
            f"{WRONG}: your rule takes the newest request, sequence_lru's rule, which never looks at "
            f"where memory is short. {where}"
        )
    if lowest:
        return f"{WRONG}: your rule takes the request making the *least* room (min instead of max?). {where}"
    if held_only:
        return (
            f"{WRONG}: your rule counts the blocks a request holds on the short device but not the "
            f"blocks the first candidate's step would take there (need.request_need), which preempting "
            f"it also spares. {where}"
        )
    if everywhere:
        return (
            f"{WRONG}: your rule counts a request's blocks on every device; only the short device is "
            f"short, and blocks freed elsewhere do not help it. {where}"
        )
    return f"{WRONG}: {where}"


# ---------------------------------------------------------------------------------------------------
# 06: how much of a prompt a prefix hit reuses


EXERCISE_06_PROMPT_LEN = 128
EXERCISE_06_SHARED = 100  # the first 100 tokens of both prompts are the same
EXERCISE_06_BLOCK_SIZE = 16


@lru_cache(maxsize=1)
def solution_hit_tokens() -> int:
    """The prompt tokens the second of two requests starts from, out of the first's cached blocks,
    on the real engine: two few-shot prompts sharing their first EXERCISE_06_SHARED tokens, the
    second added once the first has finished."""
    model = load_default_model("topk")
    workload = few_shot_workload(
        2,
        prompt_len=EXERCISE_06_PROMPT_LEN,
        shared_share=EXERCISE_06_SHARED / EXERCISE_06_PROMPT_LEN,
        output_len=4,
    )
    engine = LLMEngine(
        model,
        2000,
        EXERCISE_06_BLOCK_SIZE,
        SchedulerConfig(max_num_seqs=2),
        enable_prefix_caching=True,
        record_history=True,
    )
    for request in workload:
        engine.add_request(request.prompt, request.sampling_params)
        while engine.has_unfinished_requests():
            engine.step()
    hit = engine.requests[1].prefix_hit
    return 0 if hit is None else hit.num_tokens


@_wrapped
def check_hit_tokens(answer) -> str:
    """Is `answer` the number of prompt tokens the second request reuses from the cache?"""
    P = EXERCISE_06_BLOCK_SIZE
    S = EXERCISE_06_SHARED
    if answer is None:
        return (
            f"{MISSING}: replace None with a number of tokens. Hint: a block is found by the key of "
            f"every token up to its end, in chunks of P = {P}."
        )
    if not is_integer(answer) or not 0 <= answer <= EXERCISE_06_PROMPT_LEN:
        return f"{WRONG}: {answer!r} is not a number of tokens from 0 to {EXERCISE_06_PROMPT_LEN}."
    right = solution_hit_tokens()
    if answer == right:
        return (
            f"{RIGHT}: the hit reuses {right} tokens: the {right // P} chunks of {P} made only of shared "
            f"tokens. The chunk holding tokens {right}-{right + P - 1} mixes the last {S - right} shared "
            f"tokens with the request's own, so its key differs and those {S - right} are computed again."
        )
    if answer > S:
        return (
            f"{WRONG}: the prompts share only their first {S} tokens; a token past them differs, and so "
            f"does the key of every chunk that holds one."
        )
    if answer == S:
        return (
            f"{WRONG}: a hit reuses whole chunks of P = {P} tokens (whole blocks of each row): a chunk "
            f"is found by a key over every token up to its end, and the chunk that holds the last "
            f"shared tokens holds some of the request's own too."
        )
    if answer % P:
        return f"{WRONG}: a hit is a whole number of chunks of P = {P} tokens."
    return (
        f"{WRONG}: too few: every chunk of {P} tokens made only of shared tokens is found, however "
        f"many precede it."
    )


# ---------------------------------------------------------------------------------------------------
# 07: placing experts on ranks


EXERCISE_07_LAYER = 0
EXERCISE_07_WORLD_SIZE = 2
MAX_KV_IMBALANCE = 1.10  # max / mean K/V entries per rank under kv_with_expert
RANKS_TOUCHED_SLACK = 1.05  # within 5% of the fewest ranks touched that the balance bound allows


def placement_measures(selected, rank_of_expert, world_size: int) -> tuple[float, float]:
    """(ranks a token touches on average, K/V imbalance max / mean over ranks) of one layer's routing
    `selected` (N, E) bool under the placement `rank_of_expert` (E,)."""
    rank_of_expert = torch.as_tensor(rank_of_expert, dtype=torch.int64)
    touched = float(devices_touched(selected, rank_of_expert, world_size).double().mean())
    load = torch.zeros(world_size, dtype=torch.int64).index_add_(
        0, rank_of_expert, selected.sum(0).to(torch.int64)
    )
    return touched, float(load.max() / load.double().mean())


def _balanced_placements(num_experts: int, world_size: int):
    """Every way to put num_experts / world_size experts on each rank, up to renaming the ranks."""
    per_rank = num_experts // world_size

    def fill(rank_of_expert, rank):
        free = [e for e in range(num_experts) if rank_of_expert[e] < 0]
        if not free:
            yield tuple(rank_of_expert)
            return
        first = free[0]  # the lowest free expert opens the next rank: no renamed duplicates
        for others in combinations(free[1:], per_rank - 1):
            placed = list(rank_of_expert)
            for e in (first, *others):
                placed[e] = rank
            yield from fill(placed, rank + 1)

    yield from fill([-1] * num_experts, 0)


def solution_expert_placement(selected, world_size: int = EXERCISE_07_WORLD_SIZE) -> list[int]:
    """The balanced placement (E / D experts per rank) touching the fewest ranks per token among those
    whose K/V imbalance is at most MAX_KV_IMBALANCE: exhaustive search (35 placements for 8 experts
    on 2 ranks), where the package's co-activation placement is a greedy heuristic."""
    num_experts = selected.shape[1]
    scored = [
        (placement_measures(selected, p, world_size), p)
        for p in _balanced_placements(num_experts, world_size)
    ]
    allowed = [(m, p) for m, p in scored if m[1] <= MAX_KV_IMBALANCE]
    if not allowed:
        raise ValueError(
            f"no placement of {num_experts} experts on {world_size} ranks keeps this routing's K/V "
            f"imbalance <= {MAX_KV_IMBALANCE}: an expert's load alone exceeds what one rank may hold"
        )
    return list(min(allowed, key=lambda mp: mp[0])[1])


@_wrapped
def check_expert_placement(answer, selected, world_size: int = EXERCISE_07_WORLD_SIZE) -> str:
    """Is `answer` (the rank of each expert) balanced in weights, in K/V (imbalance <= 1.10), and
    within 5% of the fewest ranks per token such a placement can touch?"""
    num_experts = selected.shape[1]
    per_rank = num_experts // world_size
    if answer is None:
        return (
            f"{MISSING}: replace None with a list of {num_experts} ranks, one per expert (0 to "
            f"{world_size - 1}), {per_rank} experts per rank. Hint: put experts that are chosen together "
            f"on one rank, and keep the most loaded experts apart."
        )
    answer = list(answer)
    if len(answer) != num_experts or any(not is_integer(r) or not 0 <= r < world_size for r in answer):
        return (
            f"{WRONG}: the answer must list {num_experts} ranks, each an integer from 0 to "
            f"{world_size - 1} (expert e goes to rank answer[e]); got {answer}."
        )
    per_rank_counts = torch.bincount(torch.tensor(answer), minlength=world_size).tolist()
    if any(count != per_rank for count in per_rank_counts):
        return (
            f"{WRONG}: ranks hold {per_rank_counts} experts; each must hold {per_rank}, so that every "
            f"rank stores the same weights and runs the same expert work per token."
        )
    touched, imbalance = placement_measures(selected, answer, world_size)
    round_robin = placement_measures(selected, torch.arange(num_experts) % world_size, world_size)
    greedy_map = place_experts(num_experts, world_size, "coactivation", coactivation_counts(selected))
    greedy = placement_measures(selected, greedy_map, world_size)
    load = selected.sum(0)
    if imbalance > MAX_KV_IMBALANCE:
        heaviest = load.argsort(descending=True)[:2].tolist()
        return (
            f"{WRONG}: the K/V imbalance is {imbalance:.3f} > {MAX_KV_IMBALANCE:.2f}: under kv_with_expert one "
            f"rank stores {imbalance:.2f}x the mean of the K/V and fills its pool first. Expert loads "
            f"differ (the heaviest, {heaviest[0]} and {heaviest[1]}, hold {int(load[heaviest[0]])} and "
            f"{int(load[heaviest[1]])} entries); spread the heavy ones. (The package's greedy co-activation "
            f"placement, {greedy_map.tolist()}, has this problem too: imbalance {greedy[1]:.3f}.)"
        )
    best = placement_measures(selected, solution_expert_placement(selected, world_size), world_size)
    if touched > RANKS_TOUCHED_SLACK * best[0]:
        pairs = coactivation_counts(selected).triu(1)
        top = [divmod(int(i), num_experts) for i in pairs.flatten().argsort(descending=True)[:3]]
        return (
            f"{WRONG}: balanced ({imbalance:.3f}), but a token touches {touched:.3f} ranks on average "
            f"(round-robin {round_robin[0]:.3f} on this layer's {selected.shape[0]} tokens; section 4's table "
            f"averages every layer over the second half of the text); a placement within the balance bound reaches "
            f"{best[0]:.3f}. Each rank a token touches receives one copy of its hidden state, so put "
            f"experts that are chosen together on one rank: the most frequent pairs are "
            f"{', '.join(f'{a}+{b}' for a, b in top)}."
        )
    return (
        f"{RIGHT}: a token touches {touched:.3f} ranks on average (round-robin {round_robin[0]:.3f} on "
        f"this layer's {selected.shape[0]} tokens, where section 4's table averages every layer over the second "
        f"half of the text; the best balanced placement {best[0]:.3f}) and the K/V imbalance is "
        f"{imbalance:.3f}. The package's "
        f"greedy co-activation placement touches {greedy[0]:.3f} but its imbalance is {greedy[1]:.3f}: "
        f"grouping experts that fire together also groups load, and a placement must watch both."
    )


# ---------------------------------------------------------------------------------------------------
# 08: a split size for split-K decode attention


EXERCISE_08_NUM_ROWS = 4  # the split-K line of the report: 4 rows x 32768 tokens, Hkv 4
EXERCISE_08_CONTEXT = 32768
EXERCISE_08_NUM_KV_HEADS = 4
EXERCISE_08_NUM_SMS = GPUS["H100"].num_sms  # 132, H100 SXM and H200
EXERCISE_08_TOKEN_TILE = 16  # TOKEN_TILE at Dh = 128: a split is a whole number of tiles


def split_k_programs(
    tokens_per_split: int,
    num_rows: int = EXERCISE_08_NUM_ROWS,
    context: int = EXERCISE_08_CONTEXT,
    num_kv_heads: int = EXERCISE_08_NUM_KV_HEADS,
) -> int:
    """Programs of one split-K launch: one per (row, KV head, split of tokens_per_split tokens)."""
    return num_rows * num_kv_heads * ceil_div(context, tokens_per_split)


def solution_tokens_per_split(blocks_per_sm: int, num_sms: int = EXERCISE_08_NUM_SMS) -> int:
    """The largest multiple of the token tile whose launch has a program for every resident-block slot
    of the GPU (num_sms x blocks_per_sm), so that no SM waits for work."""
    needed = num_sms * blocks_per_sm
    candidates = range(EXERCISE_08_CONTEXT, 0, -EXERCISE_08_TOKEN_TILE)
    return next(t for t in candidates if split_k_programs(t) >= needed)


@_wrapped
def check_tokens_per_split(answer, blocks_per_sm: int, num_sms: int = EXERCISE_08_NUM_SMS) -> str:
    """Is `answer` the largest tokens_per_split (a multiple of the 16-token tile) that gives every
    resident-block slot of the GPU a program?"""
    needed = num_sms * blocks_per_sm
    per_split = EXERCISE_08_NUM_ROWS * EXERCISE_08_NUM_KV_HEADS
    if answer is None:
        return (
            f"{MISSING}: replace None with a tokens_per_split. Hint: the launch runs {EXERCISE_08_NUM_ROWS} "
            f"rows x {EXERCISE_08_NUM_KV_HEADS} KV heads = {per_split} programs per split; the GPU holds "
            f"{num_sms} SMs x {blocks_per_sm} blocks at once."
        )
    if not is_integer(answer) or answer < 1:
        return f"{WRONG}: {answer!r} must be a positive whole number of tokens."
    if answer % EXERCISE_08_TOKEN_TILE:
        rounded = ceil_div(answer, EXERCISE_08_TOKEN_TILE) * EXERCISE_08_TOKEN_TILE
        return (
            f"{WRONG}: {answer} is not a multiple of the {EXERCISE_08_TOKEN_TILE}-token tile the kernel "
            f"walks a split in; the launcher would round it up to {rounded}. Give a multiple of "
            f"{EXERCISE_08_TOKEN_TILE}."
        )
    programs = split_k_programs(answer)
    right = solution_tokens_per_split(blocks_per_sm, num_sms)
    splits = ceil_div(EXERCISE_08_CONTEXT, answer)
    if programs < needed:
        return (
            f"{WRONG}: {splits} split(s) per row give {programs} programs, fewer than the {needed} "
            f"({num_sms} SMs x {blocks_per_sm} resident blocks) the GPU can run at once: "
            f"{100 * (1 - programs / needed):.0f}% of its slots wait for work, and a decode kernel that "
            f"cannot keep enough loads in flight runs below memory bandwidth. Use smaller splits."
        )
    if answer == right:
        return (
            f"{RIGHT}: {splits} splits per row, {programs} programs for {needed} slots. Twice as large "
            f"({2 * answer} tokens) gives {split_k_programs(2 * answer)} programs and leaves SMs idle; "
            f"smaller splits would only add partial results for the combine kernel to read back."
        )
    return (
        f"{WRONG}: {programs} programs fill the {needed} slots, but a larger split fills them too; every "
        f"program beyond what the GPU needs writes a partial output and its log-sum-exp that the "
        f"combine kernel must read back: more bytes for nothing. Take the largest split that still "
        f"fills it."
    )


# ---------------------------------------------------------------------------------------------------
# 09: what routing attention costs at equal KV bytes, as a perplexity ratio


def solution_perplexity_ratio(family: dict) -> float:
    """expert_topk's per-byte perplexity over dense_kv_matched's (the dense model holding the same KV
    bytes per token): 2 to the power of the gap in bits per byte, from the family's JSON."""
    variants = family["variants"]
    gap = variants["expert_topk"]["bits_per_byte_mean"] - variants["dense_kv_matched"]["bits_per_byte_mean"]
    return 2.0**gap


@_wrapped
def check_perplexity_ratio(answer, family: dict) -> str:
    """Is `answer` expert_topk's per-byte perplexity over dense_kv_matched's, within 1%?"""
    if answer is None:
        return (
            f"{MISSING}: replace None with a number. Hint: bits per byte are a log2; a gap of g bits "
            f"per byte multiplies the per-byte perplexity by 2 ** g."
        )
    if not isinstance(answer, (int, float)) or isinstance(answer, bool) or not answer > 0:
        return f"{WRONG}: {answer!r} is not a positive number: a ratio of two perplexities is one."
    variants = family["variants"]
    right = solution_perplexity_ratio(family)
    gap = variants["expert_topk"]["bits_per_byte_mean"] - variants["dense_kv_matched"]["bits_per_byte_mean"]
    if _close(answer, right, 0.01):
        return (
            f"{RIGHT}: {variants['expert_topk']['bits_per_byte_mean']:.3f} - "
            f"{variants['dense_kv_matched']['bits_per_byte_mean']:.3f} = {gap:.3f} bits per byte, and "
            f"2 ** {gap:.3f} = {right:.3f}: at equal KV bytes per token, routing attention makes each "
            f"byte about {100 * (right - 1):.0f}% harder to predict in these models."
        )
    if _close(answer, gap, 0.02):
        return f"{WRONG}: that is the gap in bits per byte; the perplexity ratio is 2 to that power."
    if _close(answer, 1 / right, 0.01):
        return f"{WRONG}: that is the ratio the other way round: expert_topk's over dense_kv_matched's."
    against_dense = 2.0 ** (
        variants["expert_topk"]["bits_per_byte_mean"] - variants["dense"]["bits_per_byte_mean"]
    )
    if _close(answer, against_dense, 0.01):
        return (
            f"{WRONG}: that compares with `dense`, which holds half the KV bytes of expert_topk; the "
            f"question is at equal KV bytes: `dense_kv_matched`."
        )
    return f"{WRONG}: {answer} is {'above' if answer > right else 'below'} the ratio by more than 1%."


# ---------------------------------------------------------------------------------------------------
# 10: the smallest row budget at which drop refuses nothing


EXERCISE_10_SPAN = (3602, 3756)  # 154 bytes of the held-out text: an attention layer's __init__


def exercise_10_text() -> str:
    """The snippet notebook 10 maps and its exercise asks about: a fixed slice of the held-out text
    (analysis.heldout_text, Python the embedded model never trained on)."""
    start, stop = EXERCISE_10_SPAN
    return heldout_text()[start:stop]


@lru_cache(maxsize=None)
def exercise_10_row_lengths() -> torch.Tensor:
    """(L, E) the tokens routed to each (layer, expert) row of the embedded model (top-2) over the
    snippet, without a budget: what each row would hold."""
    model = load_default_model()
    with torch.inference_mode():
        output = model(torch.tensor([encode(exercise_10_text())]))
    return torch.stack([routing.selected[0].sum(0) for routing in output.attention_routing])


@lru_cache(maxsize=None)
def _exercise_10_refused(max_tokens: int) -> int:
    """Pairs refused over every layer when the snippet is cached (one prefill) under a drop budget of
    max_tokens per row: the paged cache's own count."""
    model = load_default_model()
    tokens = torch.tensor(encode(exercise_10_text()))
    cache = PagedKVCache.for_model(model, max_num_seqs=1, budget=RowBudget(max_tokens, "drop"))
    with torch.inference_mode():
        model.forward_cached(tokens, torch.zeros_like(tokens), torch.arange(len(tokens)), cache)
    return cache.manager.budget.num_refused


def solution_drop_budget() -> int:
    """The smallest B at which drop refuses no token of the snippet: the longest row over every
    layer and expert (drop refuses exactly a row's tokens beyond its first B)."""
    return int(exercise_10_row_lengths().max())


@_wrapped
def check_drop_budget(answer) -> str:
    """Is `answer` the smallest row budget B at which drop refuses no token of the snippet? Caches
    the snippet under a drop budget of `answer` and counts what is refused; names the usual mistakes."""
    lengths = exercise_10_row_lengths()  # (L, E)
    num_layers, num_experts = lengths.shape
    num_tokens = len(exercise_10_text().encode())
    mean = float(lengths.double().mean())  # k T / E
    if answer is None:
        return (
            f"{MISSING}: replace None with the smallest B. Hint: drop refuses a token only when "
            f"its row already holds B tokens, so the answer is set by the rows that grow longest; "
            f"the mean row holds k T / E = {mean:.1f} tokens, and there are {num_layers} layers."
        )
    if not is_integer(answer) or answer < 1:
        return f"{WRONG}: {answer!r} must be a positive whole number of tokens per row."
    right = solution_drop_budget()
    layer, expert = divmod(int(lengths.argmax()), num_experts)
    refused = 0 if answer >= num_tokens else _exercise_10_refused(answer)  # no row exceeds T
    if answer == right and refused == 0:
        return (
            f"{RIGHT}: the longest row, expert {expert} of layer {layer}, is routed {right} of the "
            f"{num_tokens} tokens, so B = {right} refuses nothing and B = {right - 1} refuses "
            f"{_exercise_10_refused(right - 1)} pair(s). The mean row holds k T / E = {mean:.1f}: "
            f"routing is uneven, so a cap that never bites is {right / mean:.1f}x the mean row, and "
            f"is known only once the router has run. A budget set before the routing is known "
            f"bounds memory by binding on the busiest rows first."
        )
    if refused == 0 and answer >= num_tokens:
        return (
            f"{WRONG}: B = {answer} refuses nothing, whatever the routing: no row can be routed "
            f"more than the {num_tokens} tokens of the sequence. But the router spreads them over "
            f"{num_experts} experts, and a far smaller B refuses nothing here too."
        )
    if refused == 0:
        return (
            f"{WRONG}: B = {answer} refuses nothing, but so does a smaller B: no row here is routed "
            f"{answer} tokens. Find the length of the longest row."
        )
    if abs(answer - mean) < 1:
        return (
            f"{WRONG}: {answer} is the mean row, k T / E = {mean:.1f} tokens, and drop refuses "
            f"{refused} pair(s) there: routing is uneven, some rows are routed far more than the "
            f"mean, and drop refuses each of their tokens beyond the first B."
        )
    longest_per_layer = lengths.max(1).values.tolist()
    if answer in longest_per_layer:
        other = longest_per_layer.index(answer)
        return (
            f"{WRONG}: {answer} is the longest row of layer {other}, and drop refuses {refused} "
            f"pair(s) there: the budget holds in every layer, and layer {layer} has a longer row."
        )
    return (
        f"{WRONG}: at B = {answer} drop refuses {refused} pair(s): some row is routed more than "
        f"{answer} tokens. Count the tokens routed to each (layer, expert) row and take the longest."
    )


# ---------------------------------------------------------------------------------------------------
# 11: what worst-case reservation sets aside for a prompt on a cluster


EXERCISE_11_PROMPT_TOKENS = 1000  # about the mean prompt of bench cluster's Azure lengths
EXERCISE_11_DEVICES = 8  # bench cluster's GPUs: one expert of every layer each
EXERCISE_11_GIB_PER_DEVICE = 0.5  # the smaller of bench cluster's pools


@lru_cache(maxsize=None)
def exercise_11_reservation(reservation: str) -> tuple[int, ...]:
    """The blocks the scheduler sets aside on each GPU, (D,) as a tuple, for the prefill of a fresh
    request of EXERCISE_11_PROMPT_TOKENS prompt tokens, under `reservation` ("worst_case" or
    "optimistic"), on bench cluster's model and placement: the real Scheduler's step_blocks_many,
    in a trace runner built as bench cluster builds it (predicted admission, its pool), never run."""
    config = get_config(MODEL)
    trace, _ = topic_trace(
        1,
        config.num_hidden_layers,
        config.num_attention_experts,
        config.num_attention_experts_per_tok,
        kv_bytes_per_slot=config.kv_bytes_per_entry(),
        lengths=([EXERCISE_11_PROMPT_TOKENS], [1]),
    )
    setup = EvictionSetup(
        blocks_per_device=pool_blocks(EXERCISE_11_GIB_PER_DEVICE),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=8192,
        admission="predicted",
        reservation=reservation,
    )
    runner = TraceRunner(trace, cluster_placement(EXERCISE_11_DEVICES), setup, "sequence_lru", None)
    request = runner.scheduler.waiting[0]
    return tuple(runner.scheduler.step_blocks_many([request], [EXERCISE_11_PROMPT_TOKENS])[0].tolist())


def solution_prompt_reservation() -> int:
    """Blocks worst-case reservation sets aside on one GPU for the prompt (the same on every GPU:
    each holds one expert of every layer): every prompt token may choose that GPU's expert in
    every layer, so each of the L rows there may take ceil(T / P) blocks."""
    return exercise_11_reservation("worst_case")[0]


@_wrapped
def check_prompt_reservation(answer) -> str:
    """Is `answer` the number of blocks worst-case reservation sets aside on one GPU for the prompt?
    Compares with the real scheduler's reservation; names the usual mistakes."""
    config = get_config(MODEL)
    T = EXERCISE_11_PROMPT_TOKENS
    P = BLOCK_SIZE
    L = config.num_hidden_layers
    E = config.num_attention_experts
    k = config.num_attention_experts_per_tok
    D = EXERCISE_11_DEVICES
    if answer is None:
        return (
            f"{MISSING}: replace None with a number of blocks on one GPU. Hint: the worst case is the "
            f"routing that puts the most of the prompt's {T} tokens on that GPU; it holds one expert "
            f"of each layer, and a block holds {P} tokens of one row."
        )
    if not is_integer(answer) or answer < 1:
        return f"{WRONG}: {answer!r} is not a positive whole number of blocks."
    worst = exercise_11_reservation("worst_case")
    if len(set(worst)) != 1:  # every GPU holds one expert of every layer: the same on each
        raise RuntimeError(f"the GPUs' worst cases differ: {worst}")
    right = worst[0]
    optimistic = exercise_11_reservation("optimistic")[0]
    pool = pool_blocks(EXERCISE_11_GIB_PER_DEVICE)
    row = ceil_div(T, P)
    if answer == right:
        return (
            f"{RIGHT}: {right} blocks on every GPU: any token may choose the GPU's expert in every one "
            f"of the {L} layers, so each of its {L} rows there may reach {T} tokens, {row} blocks of "
            f"{P}. That is {100 * right / pool:.0f}% of a pool of {pool} blocks ({EXERCISE_11_GIB_PER_DEVICE:g} "
            f"GiB per GPU), and {right / optimistic:.1f}x the {optimistic} blocks optimistic reservation "
            f"sets aside (the blocks the predictor expects, 1/{D} of them on each GPU: top-{k} of {E} "
            f"experts sends a token to a given expert {k} times in {E}). Only {pool // right} such "
            f"prompts' worst cases fit in a pool at once, whatever their routing turns out to be: "
            f"this is why admission waits under worst-case reservation while the pools stay under "
            f"half full."
        )
    if answer in (row, row - 1):
        return (
            f"{WRONG}: {answer} blocks is one row, one layer's expert on this GPU. The GPU holds an "
            f"expert of each of the {L} layers, and the prompt's tokens may choose every one of them."
        )
    if answer == k * right:
        return (
            f"{WRONG}: a token goes to k = {k} experts of a layer, but this GPU holds only one expert of "
            f"each layer: a token adds at most one entry per layer here, so k does not multiply the "
            f"GPU's worst case."
        )
    if answer == D * right or answer == D * k * right:
        return (
            f"{WRONG}: that counts every GPU; each GPU has its own pool, and the question asks for "
            f"the blocks set aside on one of them."
        )
    if answer in (L * T, k * L * T):
        return f"{WRONG}: that is a number of slots (tokens); a block holds {P} of them."
    if answer == L * T // P or answer == L * T / P:
        return (
            f"{WRONG}: almost: a row takes whole blocks, so its last block, only partly filled, is "
            f"taken whole too. Round up per row, not over the whole GPU."
        )
    if _close(answer, optimistic, 0.1):  # L * k * T / (E * P) = 375, with tails 384 or the predictor's
        return (
            f"{WRONG}: that is about the blocks the prompt is *expected* to take on one GPU (what "
            f"optimistic reservation sets aside). Worst-case reservation cannot know the routing "
            f"before the forward runs: it assumes every token chooses this GPU's expert in every layer."
        )
    direction = "too few" if answer < right else "too many"
    return (
        f"{WRONG}: {answer} is {direction}. Count, layer by layer, the most blocks the prompt's tokens "
        f"can open in the one row this GPU holds for that layer, then add the layers."
    )
