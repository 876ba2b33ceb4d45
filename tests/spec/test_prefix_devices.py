"""Prefix caching over several devices: 40 seeded random programs on the embedded model, each serving
every request with the tokens it gets when generated alone, with no exception leaving a step.

A program draws 2 or 4 devices, rows placed by expert (a random device_of_expert) or by home
(home_devices=True), preemption by recompute or by swap, optimistic or predicted admission, and 3 to
5 requests from a menu of prompts that share prefixes, arriving at staggered steps; its pool is the
smallest each device accepts for those requests (every fifth program) or a few blocks more. After
every step no tensor of the state a step changes (moekv_ref/state.py) is an inference tensor: the
forward runs in inference mode and allocates blocks there, and a pool count it replaced there could
no longer be changed in place outside it (a prefix hit's allocation raised RuntimeError, in one
program of ten). The test fails unless the programs reach each device count and placement,
preemption by recompute and by swap, prefix hits, late arrivals and the smallest pools.
"""

from collections import deque

import pytest
import torch

from moekv_ref.cache import BlockPool, CachingBlockPool
from moekv_ref.checkpoint import load_default_model
from moekv_ref.engine import LLMEngine, SchedulerConfig
from moekv_ref.engine.demand import worst_case_lifetime_blocks_per_device
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams
from moekv_ref.sim.counting import CountingBlockPool
from moekv_ref.state import Stateful

BLOCK_SIZE = 4
NUM_PROGRAMS = 40
# prompts sharing prefixes (whole blocks of 4 tokens and more): a menu the programs draw requests from
SHARED = (list(b"import numpy as np\nimport torch\n"), list(b"def main(argv):\n    return 0\n"))


@pytest.fixture(scope="module")
def model():
    return load_default_model()


@pytest.fixture(scope="module")
def menu(model):
    """(prompt, params, tokens when generated alone) of each request a program may draw."""
    generator = torch.Generator().manual_seed(0)
    entries = []
    for i in range(10):
        shared = SHARED[i % 2]
        length = int(torch.randint(16, len(shared) + 1, (), generator=generator))
        own = torch.randint(0, 256, (i % 3,), generator=generator).tolist()
        params = SamplingParams(max_new_tokens=8 + i % 7, temperature=0.0 if i % 3 else 0.8, seed=i)
        prompt = shared[:length] + own
        entries.append((prompt, params, generate(model, [prompt], [params], cache="contiguous").tokens[0]))
    return entries


def inference_tensors(obj: Stateful, path: str = "scheduler") -> list[str]:
    """Where the state a step changes (each class's STATE, down its PARTS, requests included) holds an
    inference tensor."""
    found = []

    def look(value, where):
        if isinstance(value, torch.Tensor):
            if value.is_inference():
                found.append(where)
        elif isinstance(value, Stateful):
            found.extend(inference_tensors(value, where))
        elif isinstance(value, (list, tuple, deque, set)):
            for i, item in enumerate(value):
                look(item, f"{where}[{i}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                look(item, f"{where}[{key!r}]")

    for name in obj.STATE:
        look(getattr(obj, name), f"{path}.{name}")
    for name in obj.PARTS:
        if getattr(obj, name) is not None:
            look(getattr(obj, name), f"{path}.{name}")
    return found


def smallest_pool(model, placement: dict, num_devices: int, requests) -> list[int]:
    """The fewest blocks each device may have for the engine to accept every request (with ids in
    the order given): each device's worst case of its largest request there, and at least a block
    for each row one token may have there (each layer: its experts on the device, k at most)."""
    c = model.config
    L, K = c.num_hidden_layers, c.num_attention_experts_per_tok
    if "device_of_expert" in placement:
        on_device = torch.bincount(placement["device_of_expert"], minlength=num_devices)  # (D,) experts
        one_token = L * torch.clamp(on_device, max=K)
    else:  # every row of a sequence on its home device
        one_token = torch.full((num_devices,), L * K)
    probe = LLMEngine(model, block_size=BLOCK_SIZE, blocks_per_device=[10_000] * num_devices, **placement)
    memory = probe.scheduler.memory
    least = one_token
    for request_id, (prompt, params) in enumerate(requests):
        worst = worst_case_lifetime_blocks_per_device(
            torch.tensor([len(prompt) + params.max_new_tokens - 1]),
            K,
            BLOCK_SIZE,
            memory.placement.of_sequences([request_id]),
            num_devices,
            memory.max_row_tokens,
        )[0]
        least = torch.maximum(least, worst)
    return [max(1, n) for n in least.tolist()]


def accepts(model, config, sizes, placement, requests) -> bool:
    try:
        engine = LLMEngine(
            model,
            block_size=BLOCK_SIZE,
            scheduler_config=config,
            blocks_per_device=sizes,
            enable_prefix_caching=True,
            **placement,
        )
        for prompt, params in requests:
            engine.add_request(prompt, params)
    except ValueError:
        return False
    return True


def program(model, menu, seed: int):
    """One seeded program: (engine options, the pool per device, arrivals: (step, menu index) in
    order, what it is made of for the coverage check)."""
    g = torch.Generator().manual_seed(seed)

    def rand(low, high):
        return int(torch.randint(low, high + 1, (), generator=g))

    num_devices = (2, 4)[seed % 2]
    by_home = seed // 2 % 2 == 1
    mode = ("recompute", "swap")[seed // 4 % 2]
    if by_home:
        placement = dict(home_devices=True)
    else:  # every expert of every layer on a random device (a device may hold none)
        experts = model.config.num_attention_experts
        placement = dict(device_of_expert=torch.randint(0, num_devices, (experts,), generator=g))
    config = SchedulerConfig(
        max_num_seqs=rand(4, 7),
        max_num_batched_tokens=rand(24, 64),
        preemption_mode=mode,
        admission=("optimistic", "optimistic", "predicted")[rand(0, 2)],
    )
    arrivals = sorted((rand(0, 3), rand(0, len(menu) - 1)) for _ in range(rand(5, 7)))
    requests = [menu[i][:2] for _, i in arrivals]
    smallest = smallest_pool(model, placement, num_devices, requests)
    sizes = smallest if seed % 5 == 0 else [n + rand(0, 4) for n in smallest]
    options = dict(scheduler_config=config, enable_prefix_caching=True, **placement)
    made_of = {f"{num_devices} devices", "by home" if by_home else "by expert"}
    if seed % 5 == 0:
        assert accepts(model, config, sizes, placement, requests), "the smallest pool is refused"
        for d, n in enumerate(sizes):  # one block fewer on any device is refused
            fewer = sizes[:d] + [n - 1] + sizes[d + 1 :]
            assert n == 1 or not accepts(model, config, fewer, placement, requests), (seed, d)
        made_of.add("smallest pool")
    return options, sizes, arrivals, made_of


def run_program(model, menu, seed: int) -> set:
    """Serve the program to the end, checking after every step; returns what it reached."""
    options, sizes, arrivals, seen = program(model, menu, seed)
    engine = LLMEngine(model, block_size=BLOCK_SIZE, blocks_per_device=sizes, **options)
    pending, served_from, outputs = deque(arrivals), {}, {}
    while pending or engine.has_unfinished_requests():
        assert engine.step_count < 300, f"program {seed}: the engine does not make progress"
        while pending and pending[0][0] <= engine.step_count:
            _, i = pending.popleft()
            served_from[engine.add_request(*menu[i][:2])] = i
            if engine.step_count and engine.has_unfinished_requests():
                seen.add("arrival while others run")
        if engine.has_unfinished_requests():
            for output in engine.step():  # any exception fails the test
                outputs[output.request_id] = output
        else:
            engine.idle_step()
        bad = inference_tensors(engine.scheduler)
        assert not bad, f"program {seed}, step {engine.step_count - 1}: inference tensors {bad}"
    assert sorted(outputs) == sorted(served_from), f"program {seed}: a request was lost"
    for request_id, i in served_from.items():
        output = outputs[request_id]
        assert output.finish_reason == "length", (seed, request_id, output.finish_reason)
        assert output.token_ids == menu[i][2], (seed, request_id)
    engine.memory.assert_no_leak()
    engine.cache.manager.assert_consistent()
    stats, hits = engine.stats(), engine.prefix_cache_stats()
    assert stats.num_failed_steps == 0, seed
    mode = options["scheduler_config"].preemption_mode
    if stats.num_preemptions and (mode == "recompute" or stats.num_swapped_out_blocks):
        seen.add(f"preempted by {mode}")
    if hits["num_hit_tokens"]:
        seen.add("prefix hit")
    return seen


def test_prefix_caching_on_several_devices_serves_every_request_as_if_alone(model, menu):
    seen = set()
    for seed in range(NUM_PROGRAMS):
        seen |= run_program(model, menu, seed)
    expected = {
        "2 devices",
        "4 devices",
        "by expert",
        "by home",
        "smallest pool",
        "arrival while others run",
        "prefix hit",
        "preempted by recompute",
        "preempted by swap",
    }
    assert expected <= seen, expected - seen


# ----- the pool's tensors are never inference tensors ----------------------------------------------
def test_a_pool_used_inside_inference_mode_is_changed_in_place_outside_it():
    """Blocks taken and given back inside inference mode (as the forward does), then a prefix hit's
    allocation outside it that reaches into a device's cached-free blocks, and a pool built inside
    inference mode used outside it: no tensor of the pool becomes an inference tensor, and every
    call works."""
    pool = CachingBlockPool(blocks_per_device=[4, 4])
    with torch.inference_mode():
        taken = pool.allocate_per_device(torch.tensor([2, 3]))  # one gather, counts updated
    pool.mark_cached(taken[:2])
    pool.free(taken[:2])  # cached free, on device 0
    with torch.inference_mode():
        pool.free(taken[2:3])
    assert not inference_tensors(pool, "pool")
    pool.assert_consistent()
    ids = pool.allocate_per_device(torch.tensor([3, 1]))  # device 0 evicts one of its cached blocks
    assert pool.num_evicted_cached_blocks == 1
    assert pool.num_free_blocks_per_device.tolist() == [1, 1]
    pool.free(torch.cat([ids, taken[3:]]))
    pool.assert_consistent()
    assert pool.num_free_blocks_per_device.tolist() == [4, 4]

    with torch.inference_mode():
        built_inside = BlockPool(blocks_per_device=[3, 3])
    assert not inference_tensors(built_inside, "pool")
    built_inside.allocate(2, device=1)
    built_inside.assert_consistent()
    assert built_inside.num_free_blocks_per_device.tolist() == [3, 1]


def test_a_counting_pool_lent_inside_inference_mode_takes_blocks_back_outside_it():
    pool = CountingBlockPool(blocks_per_device=[5, 5])
    with torch.inference_mode():
        pool.allocate_per_device(torch.tensor([2, 1]))
    assert not inference_tensors(pool, "pool")
    pool.free_per_device(torch.tensor([1, 1]))
    pool.assert_consistent()
    with torch.inference_mode():
        pool.free_per_device(torch.tensor([1, 0]))
    assert not inference_tensors(pool, "pool")
    pool.allocate_per_device(torch.tensor([5, 0]))
    pool.assert_consistent()
    assert pool.num_free_blocks_per_device.tolist() == [0, 5]


def test_a_step_undone_inside_inference_mode_restores_no_inference_tensor(model, menu):
    """Steps run inside the caller's torch.inference_mode, one of them undone (Ctrl-C in a layer):
    the undo's copies are made outside inference mode, so the state it restores can be changed in
    place by the steps run outside it, which serve every request with its tokens of generating alone."""
    engine = LLMEngine(
        model,
        block_size=BLOCK_SIZE,
        blocks_per_device=[120, 120],
        home_devices=True,
        enable_prefix_caching=True,
    )
    append_kv = engine.cache.append_kv

    def interrupted(layer, *args):
        if engine.step_count == 2 and layer == 1:
            raise KeyboardInterrupt
        return append_kv(layer, *args)

    engine.cache.append_kv = interrupted
    requests = {engine.add_request(*menu[i][:2]): i for i in (0, 2, 4)}
    outputs = {}
    with torch.inference_mode():
        for _ in range(4):
            try:
                outputs.update((o.request_id, o) for o in engine.step())
            except KeyboardInterrupt:
                assert engine.step_count == 3
    assert engine.stats().num_failed_steps == 1
    assert not inference_tensors(engine.scheduler)
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert {r: o.token_ids for r, o in outputs.items()} == {r: menu[i][2] for r, i in requests.items()}
    engine.memory.assert_no_leak()


def test_an_engine_built_inside_inference_mode_steps_outside_it(model, menu):
    """An engine constructed inside the caller's torch.inference_mode holds no inference tensor (its
    pool, tables and demand predictor are made outside it), so steps run outside it can change them in
    place, and serve every request with its tokens of generating alone."""
    with torch.inference_mode():
        engine = LLMEngine(model, block_size=BLOCK_SIZE, blocks_per_device=[120, 120], home_devices=True)
    assert not inference_tensors(engine.scheduler)
    requests = {engine.add_request(*menu[i][:2]): i for i in (0, 2, 4)}
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert {r: o.token_ids for r, o in outputs.items()} == {r: menu[i][2] for r, i in requests.items()}
    engine.memory.assert_no_leak()
