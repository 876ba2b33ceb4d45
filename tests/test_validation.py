"""Bad input, through the API and the command line: every case gets one clear ValueError naming the
bad value and what is allowed, before any state changes. Nothing is coerced: a float block count, id
or device (even 1.0) is refused, not rounded; a bool is not read as 0 or 1; a str is not read as a
sequence of digits; a flag is True or False, not a truthy string. On the command line a bad option
is parser.error before anything runs (usage, then `error: --name=value is ...; allowed ...`, exit
status 2); an error while a command runs prints one line `error: ...` and returns 2. And two valid
inputs that used to be refused or to fail: per-prompt limits in `generate`, and a paged `generate`
of more prompts than the default pool was sized for.

The case lists are data (CASES, OPTION_CASES, CLI_CASES): the closing table of bad inputs is printed
from them.
"""

import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import random_model, small_config

from moekv_ref.apps import (
    bench_cluster,
    bench_eviction,
    bench_memory,
    bench_parallel,
    bench_peer,
    bench_serving,
    bench_step,
    capacity,
    cli,
    demo,
    family,
    figures,
    options,
    train,
)
from moekv_ref.apps.cli import main
from moekv_ref.cache import (
    BudgetedKVCacheManager,
    CachingBlockPool,
    KVCacheManager,
    PagedKVCache,
    PrefixCachingKVCacheManager,
    SharedTailKVCacheManager,
)
from moekv_ref.cache.block_pool import BlockPool
from moekv_ref.cache.budget import RowBudget
from moekv_ref.cache.options import checked_placement
from moekv_ref.config import ModelConfig
from moekv_ref.engine import LLMEngine, SchedulerConfig, generate_with_engine
from moekv_ref.engine.workload import make_workload
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams
from moekv_ref.validation import check_blocks_per_device, memory_of

MODEL = random_model(small_config("expert", "threshold"), seed=0)  # vocab 64, 96 positions, L=2, E=5
P4 = SamplingParams(max_new_tokens=4)
PLACEMENT = torch.tensor([0, 0, 1, 1, 1])  # 5 experts on 2 devices
A_FILE, A_FOLDER = str(Path(__file__).resolve()), str(Path(__file__).resolve().parent)  # whatever the cwd


def engine(**options):
    return LLMEngine(MODEL, **{"num_blocks": 64, "block_size": 4, **options})


def device_engine(blocks_per_device=(40, 40), device_of_expert=PLACEMENT, **options):
    return LLMEngine(
        MODEL, block_size=4, blocks_per_device=blocks_per_device, device_of_expert=device_of_expert, **options
    )


def pool_in_use():
    """A BlockPool of 8 blocks, 0..3 in use (block 1 twice)."""
    pool = BlockPool(8)
    pool.incref(pool.allocate(4)[1:2])
    return pool


def device_pool_in_use():
    """A BlockPool of 2 devices (blocks 0..2 and 3..4), blocks 0, 1 and 3 in use."""
    pool = BlockPool(blocks_per_device=[3, 2])
    pool.allocate(2, device=0)
    pool.allocate(1, device=1)
    return pool


def pools_in_use():
    """A KVCacheManager of 2 devices (L=2, E=5) holding sequence 7 with 3 tokens in row 0 (device 0)."""
    pools = KVCacheManager(2, 5, 2, blocks_per_device=[6, 6], device_of_expert=PLACEMENT)
    pools.add_sequence(7)
    pools.allocate_slots(torch.tensor([0]), torch.tensor([3]))
    return pools


def manager_in_use():
    manager = KVCacheManager(2, 5, 2, 12)
    manager.add_sequence(7)
    manager.allocate_slots(torch.tensor([0]), torch.tensor([3]))
    return manager


# (what is tried, the call, a fragment the error must contain)
CASES = [
    ("temperature=1e-320", lambda: SamplingParams(temperature=1e-320), "too small to sample with"),
    (
        "temperature=inf",
        lambda: SamplingParams(temperature=math.inf),
        "temperature=inf is not allowed; allowed: a finite number in [0, inf)",
    ),
    ("temperature=nan", lambda: SamplingParams(temperature=math.nan), "temperature=nan"),
    ("temperature='1'", lambda: SamplingParams(temperature="1"), "temperature='1'"),
    ("temperature=-0.5", lambda: SamplingParams(temperature=-0.5), "temperature=-0.5 is not allowed"),
    (
        "top_p=nan",
        lambda: SamplingParams(top_p=math.nan),
        "top_p=nan is not allowed; allowed: a finite number in (0, 1]",
    ),
    ("top_p=0", lambda: SamplingParams(top_p=0), "top_p=0 is not allowed"),
    (
        "max_new_tokens=2.0",
        lambda: SamplingParams(max_new_tokens=2.0),
        "max_new_tokens=2.0 is a float; allowed: an integer",
    ),
    ("max_new_tokens=True", lambda: SamplingParams(max_new_tokens=True), "max_new_tokens=True"),
    (
        "seed=-1",
        lambda: SamplingParams(seed=-1),
        "seed=-1 is not allowed; allowed: an integer in [0, 2**63 - 1]",
    ),
    ("seed=1.5", lambda: SamplingParams(seed=1.5), "seed=1.5"),
    (
        "LLMEngine num_blocks=200.0",
        lambda: engine(num_blocks=200.0),
        "num_blocks=200.0 is a float; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "LLMEngine num_blocks=0",
        lambda: engine(num_blocks=0),
        "num_blocks=0 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    ("LLMEngine num_blocks=True", lambda: engine(num_blocks=True), "num_blocks=True"),
    ("LLMEngine num_blocks=4 (< one token)", lambda: engine(num_blocks=4), "too small for even one sequence"),
    ("LLMEngine block_size=0", lambda: engine(block_size=0), "block_size=0 is not allowed"),
    ("LLMEngine block_size=3", lambda: engine(block_size=3), "power of two"),
    ("LLMEngine num_swap_blocks=-1", lambda: engine(num_swap_blocks=-1), "num_swap_blocks=-1"),
    (
        "num_swap_blocks under recompute",
        lambda: engine(num_swap_blocks=8),
        "applies to preemption_mode='swap', not 'recompute'",
    ),
    ("LLMEngine attention='fast'", lambda: engine(attention="fast"), "attention='fast' is not one of"),
    (
        "scheduler_config as a dict",
        lambda: engine(scheduler_config={"max_num_seqs": 4}),
        "must be a SchedulerConfig",
    ),
    ("LLMEngine model='tiny'", lambda: LLMEngine("tiny", 64), "model must be a MoEKVTransformer"),
    ("LLMEngine shuffle_seed=-3", lambda: engine(shuffle_seed=-3), "shuffle_seed=-3"),
    ("LLMEngine record_history='yes'", lambda: engine(record_history="yes"), "record_history='yes'"),
    (
        "SchedulerConfig max_num_seqs=0",
        lambda: SchedulerConfig(max_num_seqs=0),
        "max_num_seqs=0 is not allowed; allowed: an integer in [1, ",
    ),
    (
        "SchedulerConfig max_num_batched_tokens=2.5",
        lambda: SchedulerConfig(max_num_batched_tokens=2.5),
        "max_num_batched_tokens=2.5",
    ),
    ("SchedulerConfig policy='fifo'", lambda: SchedulerConfig(policy="fifo"), "policy='fifo' is not one of"),
    ("SchedulerConfig admission='lucky'", lambda: SchedulerConfig(admission="lucky"), "admission='lucky'"),
    (
        "SchedulerConfig preemption_mode='evict'",
        lambda: SchedulerConfig(preemption_mode="evict"),
        "preemption_mode='evict'",
    ),
    ("SchedulerConfig victim='random'", lambda: SchedulerConfig(victim="random"), "victim='random'"),
    (
        "admission under policy='static'",
        lambda: SchedulerConfig(policy="static", admission="optimistic"),
        "applies to policy='continuous_paged' only",
    ),
    (
        "expert_lru with prefix caching",
        lambda: engine(enable_prefix_caching=True, scheduler_config=SchedulerConfig(victim="expert_lru")),
        "victim='expert_lru' drops single rows, which this cache cannot",
    ),
    (
        "prefix caching under continuous_reserved",
        lambda: engine(
            enable_prefix_caching=True, scheduler_config=SchedulerConfig(policy="continuous_reserved")
        ),
        "prefix caching works with policy='continuous_paged' only, not 'continuous_reserved'",
    ),
    (
        "swap with no swap space",
        lambda: engine(scheduler_config=SchedulerConfig(preemption_mode="swap"), num_swap_blocks=0),
        "needs a swap space",
    ),
    ("add_request prompt []", lambda: engine().add_request([], P4), "is empty"),
    ("add_request float token ids", lambda: engine().add_request([1.0, 2.0], P4), "token 0 is 1.0 (float)"),
    ("add_request bool token id", lambda: engine().add_request([1, True], P4), "token 1 is True"),
    (
        "add_request token 64 (vocab 64)",
        lambda: engine().add_request([1, 64], P4),
        "outside the vocabulary [0, 64)",
    ),
    ("add_request token -1", lambda: engine().add_request([-1], P4), "token 0 is -1, outside"),
    ("add_request a str prompt", lambda: engine().add_request("hello", P4), "is text (str)"),
    (
        "add_request float tensor",
        lambda: engine().add_request(torch.tensor([1.0, 2.0]), P4),
        "1-D integer tensor",
    ),
    (
        "add_request 2-D tensor",
        lambda: engine().add_request(torch.tensor([[1, 2]]), P4),
        "1-D integer tensor",
    ),
    ("add_request prompt=5", lambda: engine().add_request(5, P4), "must be a sequence of token ids"),
    (
        "add_request prompt over max positions",
        lambda: engine(num_blocks=4096).add_request([1] * 200, P4),
        "has 200 tokens, more than the model's max_position_embeddings=96",
    ),
    (
        "add_request prompt + max_new_tokens over positions",
        lambda: engine(num_blocks=4096).add_request([1] * 90, SamplingParams(max_new_tokens=10)),
        "ask for at most 7 new tokens",
    ),
    (
        "add_request unknown sampling key",
        lambda: engine().add_request([1], {"temprature": 1.0}),
        "allowed keys",
    ),
    (
        "add_request sampling_params='greedy'",
        lambda: engine().add_request([1], "greedy"),
        "must be a SamplingParams or a dict",
    ),
    (
        "add_request that can never fit",
        lambda: engine(num_blocks=40).add_request([5] * 80, SamplingParams(max_new_tokens=10)),
        "can never fit in the pool of 40 blocks",
    ),
    ("engine.generate([])", lambda: engine().generate([]), "no prompts given"),
    ("engine.generate('abc')", lambda: engine().generate("abc"), "prompts must be a list"),
    (
        "engine.generate params count",
        lambda: engine().generate([[1], [2]], [P4]),
        "got 1 sampling params for 2 prompts",
    ),
    ("engine.generate bad prompt 1", lambda: engine().generate([[1], [2.5]], P4), "prompt 1: token 0 is 2.5"),
    (
        "abort_request(99) unknown",
        lambda: engine().abort_request(99),
        "request_id=99 is not a request of this engine",
    ),
    (
        "abort_request('0')",
        lambda: engine().abort_request("0"),
        "request_id='0' is a str; allowed: an integer >= 0 (the id of a request of this engine",
    ),
    ("generate(model, [])", lambda: generate(MODEL, []), "non-empty list of prompts"),
    ("generate cache='mmap'", lambda: generate(MODEL, [[1, 2]], cache="mmap"), "cache='mmap' is not one of"),
    (
        "generate block_size with contiguous",
        lambda: generate(MODEL, [[1, 2]], P4, cache="contiguous", block_size=4),
        "apply to cache='paged' only",
    ),
    ("generate float token", lambda: generate(MODEL, [[1, 2.5]], P4), "token 1 is 2.5"),
    (
        "generate params='greedy'",
        lambda: generate(MODEL, [[1]], "greedy"),
        "params[0] must be a SamplingParams or a dict",
    ),
    ("generate unknown params key", lambda: generate(MODEL, [[1]], {"temprature": 1.0}), "allowed keys"),
    (
        "generate over-long prompt + tokens",
        lambda: generate(MODEL, [[1] * 96], SamplingParams(max_new_tokens=5)),
        "ask for at most 1 new tokens",
    ),
    (
        "generate_with_engine block_size=0",
        lambda: generate_with_engine(MODEL, [[1]], P4, block_size=0),
        "block_size=0",
    ),
    ("generate_with_engine no prompts", lambda: generate_with_engine(MODEL, [], P4), "non-empty list"),
    ("ModelConfig rope_theta=nan", lambda: ModelConfig(rope_theta=math.nan), "rope_theta=nan is not allowed"),
    (
        "ModelConfig rms_norm_eps=-1",
        lambda: ModelConfig(rms_norm_eps=-1),
        "rms_norm_eps=-1 is not allowed; allowed: a finite number in (0, 1)",
    ),
    ("ModelConfig rms_norm_eps=inf", lambda: ModelConfig(rms_norm_eps=math.inf), "rms_norm_eps=inf"),
    (
        "ModelConfig routing_threshold=nan",
        lambda: ModelConfig(routing_threshold=math.nan),
        "routing_threshold=nan",
    ),
    (
        "ModelConfig hidden_size=128.0",
        lambda: ModelConfig(hidden_size=128.0),
        "hidden_size=128.0 is a float; allowed: an integer",
    ),
    ("ModelConfig kv_lora_rank=1.5", lambda: ModelConfig(kv_lora_rank=1.5), "kv_lora_rank=1.5"),
    ("ModelConfig.from_dict([1, 2])", lambda: ModelConfig.from_dict([1, 2]), "must be a dict of fields"),
    ("make_workload(0)", lambda: make_workload(0), "num_requests=0"),
    ("make_workload arrival_rate=inf", lambda: make_workload(4, arrival_rate=math.inf), "arrival_rate=inf"),
    ("make_workload prompt_len=(5, 2)", lambda: make_workload(4, prompt_len=(5, 2)), "prompt_len=(5, 2)"),
    ("make_workload temperature=-1", lambda: make_workload(4, temperature=-1), "temperature=-1"),
    # per-device pools: block counts and placements as given, never rounded or read as digits
    (
        "LLMEngine per-device blocks [100.7, 100.2]",
        lambda: device_engine([100.7, 100.2]),
        "blocks_per_device[0]=100.7 is a float; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "LLMEngine per-device blocks [40.0, 40.0]",
        lambda: device_engine([40.0, 40.0]),
        "blocks_per_device[0]=40.0 is a float",
    ),
    (
        "LLMEngine per-device blocks '4040'",
        lambda: device_engine("4040"),
        "blocks_per_device='4040' is a str; allowed: a list",
    ),
    (
        "LLMEngine per-device blocks [40, True]",
        lambda: device_engine([40, True]),
        "blocks_per_device[1]=True is a bool",
    ),
    (
        "LLMEngine per-device blocks [40, 0]",
        lambda: device_engine([40, 0]),
        "blocks_per_device[1]=0 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    ("LLMEngine per-device blocks []", lambda: device_engine([]), "blocks_per_device=[] is empty"),
    (
        "LLMEngine per-device blocks 80",
        lambda: device_engine(80),
        "blocks_per_device=80 is an int; allowed: a list",
    ),
    (
        "LLMEngine per-device blocks float tensor",
        lambda: device_engine(torch.tensor([40.0, 40.0])),
        "blocks_per_device=[40.0, 40.0] has dtype torch.float32",
    ),
    (
        "LLMEngine per-device blocks 2-D array",
        lambda: device_engine(np.array([[40, 40]])),
        "blocks_per_device has shape (1, 2)",
    ),
    ("LLMEngine per-device blocks {0: 40}", lambda: device_engine({0: 40, 1: 40}), "is a dict"),
    (
        "LLMEngine per-device placement 0.4",
        lambda: device_engine(device_of_expert=torch.tensor([0.4, 0, 1, 1, 1])),
        "device_of_expert[0]=0.4 has dtype torch.float32; allowed: devices 0..1",
    ),
    (
        "LLMEngine per-device placement whole floats",
        lambda: device_engine(device_of_expert=PLACEMENT.double()),
        "device_of_expert[0]=0.0 has dtype torch.float64",
    ),
    (
        "LLMEngine per-device placement list with 1.0",
        lambda: device_engine(device_of_expert=[0, 0, 1, 1, 1.0]),
        "device_of_expert[4]=1.0 is a float; allowed: devices 0..1",
    ),
    (
        "LLMEngine per-device placement (L, E) list with True",
        lambda: device_engine(device_of_expert=[[0, 0, 1, 1, 1], [0, 0, 1, 1, True]]),
        "device_of_expert[1][4]=True is a bool",
    ),
    (
        "LLMEngine per-device placement '00111'",
        lambda: device_engine(device_of_expert="00111"),
        "device_of_expert='00111' is a str",
    ),
    (
        "LLMEngine per-device placement bool tensor",
        lambda: device_engine(device_of_expert=PLACEMENT.bool()),
        "has dtype torch.bool",
    ),
    (
        "LLMEngine per-device placement float array",
        lambda: device_engine(device_of_expert=np.array([0, 0, 1, 1, 1.5])),
        "device_of_expert[4]=1.5 has dtype float64",
    ),
    (
        "LLMEngine per-device placement device 2 of 2",
        lambda: device_engine(device_of_expert=[0, 0, 1, 1, 2]),
        "device_of_expert names devices [0, 1, 2]; allowed: 0..1",
    ),
    (
        "LLMEngine per-device placement (4,)",
        lambda: device_engine(device_of_expert=[0, 0, 1, 1]),
        "device_of_expert must be (E,) = (5,) or (L, E) = (2, 5); got (2, 4)",
    ),
    (
        "LLMEngine per-device placement ragged",
        lambda: device_engine(device_of_expert=[[0, 0, 1, 1, 1], [0, 1]]),
        "not a rectangular table",
    ),
    (
        "LLMEngine per-device record_history='yes'",
        lambda: device_engine(record_history="yes"),
        "record_history='yes'",
    ),
    (
        "KVCacheManager blocks_per_device [3.5, 4]",
        lambda: KVCacheManager(1, 4, 2, blocks_per_device=[3.5, 4], device_of_expert=[0, 0, 1, 1]),
        "blocks_per_device[0]=3.5 is a float",
    ),
    (
        "KVCacheManager home_devices=1",
        lambda: KVCacheManager(1, 4, 2, blocks_per_device=[4, 4], home_devices=1),
        "home_devices=1 is an int; allowed: True or False",
    ),
    (
        "KVCacheManager home_devices with a placement",
        lambda: KVCacheManager(
            1, 4, 2, blocks_per_device=[4, 4], device_of_expert=[0, 0, 1, 1], home_devices=True
        ),
        "home_devices=True takes no device_of_expert",
    ),
    (
        "BlockPool blocks_per_device (2, 2.0)",
        lambda: BlockPool(blocks_per_device=(2, 2.0)),
        "blocks_per_device[1]=2.0 is a float",
    ),
    (
        "BlockPool 2 devices shuffle_seed=1.5",
        lambda: BlockPool(blocks_per_device=[2, 2], shuffle_seed=1.5),
        "shuffle_seed=1.5",
    ),
    (
        "KVCacheManager blocks_per_device 4.0",
        lambda: KVCacheManager(2, 5, 2, blocks_per_device=4.0, device_of_expert=PLACEMENT),
        "blocks_per_device=4.0 is a float",
    ),
    (
        "KVCacheManager placement 0.4",
        lambda: KVCacheManager(2, 5, 2, blocks_per_device=[4, 4], device_of_expert=[0.4, 0, 1, 1, 1]),
        "device_of_expert[0]=0.4 is a float; allowed: devices 0..1",
    ),
    (
        "checked_placement of a float",
        lambda: checked_placement(0.4, 2, 5, 2),
        "device_of_expert=0.4 is a float",
    ),
    # ids: never rounded to a block, row or expert, never read as 0 / 1
    (
        "BlockPool.free(tensor([1.7]))",
        lambda: pool_in_use().free(torch.tensor([1.7])),
        "block_ids=[1.7] has dtype torch.float32; allowed: integer ids",
    ),
    ("BlockPool.free([1.0])", lambda: pool_in_use().free([1.0]), "block_ids[0]=1.0 is a float"),
    ("BlockPool.free([0, True])", lambda: pool_in_use().free([0, True]), "block_ids[1]=True is a bool"),
    ("BlockPool.free(bool tensor)", lambda: pool_in_use().free(torch.tensor([True])), "has dtype torch.bool"),
    ("BlockPool.free('1')", lambda: pool_in_use().free("1"), "block_ids='1' is text"),
    ("BlockPool.free(1.0)", lambda: pool_in_use().free(1.0), "block_ids=[1.0] has dtype"),
    ("BlockPool.free(float array)", lambda: pool_in_use().free(np.array([1.0])), "has dtype torch.float64"),
    ("BlockPool.incref([1.5])", lambda: pool_in_use().incref([1.5]), "block_ids[0]=1.5 is a float"),
    (
        "CachingBlockPool.mark_cached(float)",
        lambda: caching_pool_in_use().mark_cached(torch.tensor([2.0])),
        "has dtype torch.float32",
    ),
    (
        "CachingBlockPool.reuse(float)",
        lambda: caching_pool_in_use().reuse(torch.tensor([2.0])),
        "has dtype torch.float32",
    ),
    (
        "BlockPool.allocate(2.0)",
        lambda: pool_in_use().allocate(2.0),
        "num_blocks=2.0 is a float; allowed: an integer >= 0",
    ),
    ("BlockPool.allocate(True)", lambda: pool_in_use().allocate(True), "num_blocks=True"),
    ("BlockPool.allocate(-1)", lambda: pool_in_use().allocate(-1), "num_blocks=-1"),
    (
        "BlockPool shuffle_seed=True",
        lambda: BlockPool(4, shuffle_seed=True),
        "shuffle_seed=True is a bool",
    ),
    (
        "BlockPool 2 devices .free(tensor([3.0]))",
        lambda: device_pool_in_use().free(torch.tensor([3.0])),
        "block_ids=[3.0] has dtype torch.float32",
    ),
    (
        "BlockPool 2 devices .incref([0.5])",
        lambda: device_pool_in_use().incref([0.5]),
        "block_ids[0]=0.5 is a float",
    ),
    (
        "BlockPool.device_of_blocks([True])",
        lambda: device_pool_in_use().device_of_blocks([True]),
        "block_ids[0]=True is a bool",
    ),
    (
        "BlockPool.allocate(1, device=0.4)",
        lambda: device_pool_in_use().allocate(1, device=0.4),
        "device=0.4 is a float; allowed: an integer in [0, 1]",
    ),
    (
        "BlockPool.allocate(1, device=True)",
        lambda: device_pool_in_use().allocate(1, device=True),
        "device=True",
    ),
    (
        "BlockPool.allocate(1.0, device=0)",
        lambda: device_pool_in_use().allocate(1.0, device=0),
        "num_blocks=1.0",
    ),
    (
        "KVCacheManager 2 devices .free_rows([0.0])",
        lambda: pools_in_use().free_rows([0.0]),
        "rows[0]=0.0 is a float",
    ),
    (
        "KVCacheManager 2 devices .allocate_slots float tokens",
        lambda: pools_in_use().allocate_slots(torch.tensor([0]), torch.tensor([1.5])),
        "num_new_tokens=[1.5] has dtype torch.float32",
    ),
    (
        "KVCacheManager.blocks_needed_per_device float rows",
        lambda: pools_in_use().blocks_needed_per_device(torch.tensor([0.0]), [1]),
        "rows=[0.0] has dtype",
    ),
    (
        "KVCacheManager.rows float experts",
        lambda: manager_in_use().rows([7], 0, 1.0),
        "experts=[1.0] has dtype",
    ),
    ("KVCacheManager.rows layer=0.5", lambda: manager_in_use().rows([7], 0.5, 1), "layer=0.5 is a float"),
    (
        "KVCacheManager.free_rows([True])",
        lambda: manager_in_use().free_rows([True]),
        "rows[0]=True is a bool",
    ),
    # flags: True or False, never a truthy string or 1
    (
        "generate record_logits='no'",
        lambda: generate(MODEL, [[1, 2]], P4, record_logits="no"),
        "record_logits='no' is a str; allowed: True or False",
    ),
    (
        "generate record_logits=1",
        lambda: generate(MODEL, [[1, 2]], P4, record_logits=1),
        "record_logits=1 is an int",
    ),
    (
        "generate shared_tails='no'",
        lambda: generate(MODEL, [[1, 2]], P4, cache="paged", shared_tails="no"),
        "shared_tails='no' is a str; allowed: True or False",
    ),
    (
        "generate enable_prefix_caching=0",
        lambda: generate(MODEL, [[1, 2]], P4, cache="paged", enable_prefix_caching=0),
        "enable_prefix_caching=0 is an int",
    ),
    (
        "generate home_devices='no'",
        lambda: generate(MODEL, [[1, 2]], P4, cache="paged", blocks_per_device=[90, 90], home_devices="no"),
        "home_devices='no' is a str; allowed: True or False",
    ),
    (
        "LLMEngine home_devices=1",
        lambda: LLMEngine(MODEL, blocks_per_device=[90, 90], home_devices=1),
        "home_devices=1 is an int; allowed: True or False",
    ),
    (
        "LLMEngine home_devices without blocks_per_device",
        lambda: LLMEngine(MODEL, 90, home_devices=True),
        "home_devices=True needs blocks_per_device",
    ),
    # a variant is its own class: the plain manager names the option it does not take
    (
        "KVCacheManager tails=True",
        lambda: KVCacheManager(2, 5, 2, 12, tails=True),
        "unknown keyword tails=True for KVCacheManager; allowed: num_layers, num_experts, block_size",
    ),
    (
        "KVCacheManager budget=4",
        lambda: KVCacheManager(2, 5, 2, 12, budget=4),
        "unknown keyword budget=4 for KVCacheManager",
    ),
    (
        "BudgetedKVCacheManager budget=4",
        lambda: BudgetedKVCacheManager(2, 5, 2, 12, budget=4),
        "budget=4 is an int; allowed: a RowBudget",
    ),
    (
        "KVCacheManager options= with a keyword",
        lambda: KVCacheManager(2, 5, 2, 12, options="x", shuffle_seed=1),
        "options='x' is not allowed with ['shuffle_seed']; allowed: a ManagerOptions",
    ),
    # rows: of sequences the cache holds
    (
        "KVCacheManager.allocate_slots to a row of no held sequence",
        lambda: manager_in_use().allocate_slots(torch.tensor([12]), torch.tensor([1])),
        "allocate_slots: rows [12] are not all rows of sequences the cache holds",
    ),
    (
        "KVCacheManager.allocate_slots to row -1",
        lambda: manager_in_use().allocate_slots(torch.tensor([-1]), torch.tensor([1])),
        "rows [-1] are not all rows of sequences the cache holds",
    ),
    # sizes: bounded before anything is allocated
    (
        "ModelConfig max_position_embeddings=2**40",
        lambda: ModelConfig(max_position_embeddings=2**40),
        "max_position_embeddings=1099511627776 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "LLMEngine num_blocks=2**40",
        lambda: engine(num_blocks=2**40),
        "num_blocks=1099511627776 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "LLMEngine block_size=512",
        lambda: engine(block_size=512),
        "block_size=512 is not allowed; allowed: a power of two in [1, 256]",
    ),
    (
        "LLMEngine per-device blocks [2**40, 2**40]",
        lambda: device_engine([2**40, 2**40]),
        "blocks_per_device[0]=1099511627776 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "LLMEngine per-device blocks summing past 2**31 - 1",
        lambda: device_engine([2**31 - 1, 2**31 - 1]),
        "blocks_per_device sums to 4,294,967,294 blocks; allowed: at most 2**31 - 1 in all",
    ),
    (
        "LLMEngine num_swap_blocks=2**40",
        lambda: engine(scheduler_config=SchedulerConfig(preemption_mode="swap"), num_swap_blocks=2**40),
        "num_swap_blocks=1099511627776 is not allowed; allowed: an integer in [0, 2**31 - 1]",
    ),
    (
        "KVCacheManager num_blocks=2**40",
        lambda: KVCacheManager(2, 5, 2, 2**40),
        "num_blocks=1099511627776 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "BlockPool num_blocks=2**40",
        lambda: BlockPool(2**40),
        "num_blocks=1099511627776 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
    (
        "RowBudget max_tokens=2**40",
        lambda: RowBudget(2**40),
        "max_tokens=1099511627776 is not allowed; allowed: an integer in [1, 2**31 - 1]",
    ),
]

# command-line options refused by parser.error before the command runs: (what, argv, fragment)
OPTION_CASES = [
    (
        "generate --cache paged --block-size 0",
        ["generate", "--prompt", "x", "--cache", "paged", "--block-size", "0"],
        "--block-size=0 is not allowed; allowed: a power of two",
    ),
    (
        "generate --block-size 4 (contiguous)",
        ["generate", "--prompt", "x", "--block-size", "4"],
        "--block-size applies to --cache paged",
    ),
    (
        "generate --temperature inf",
        ["generate", "--prompt", "x", "--temperature", "inf"],
        "--temperature=inf is not allowed; allowed: a finite number in [0, inf)",
    ),
    (
        "generate --temperature nan",
        ["generate", "--prompt", "x", "--temperature", "nan"],
        "--temperature=nan",
    ),
    (
        "generate --temperature 1e-320",
        ["generate", "--prompt", "x", "--temperature", "1e-320"],
        "--temperature=1e-320 is too small to sample with; allowed: 0 (greedy) or at least 0.0001",
    ),
    (
        "generate --temperature -1",
        ["generate", "--prompt", "x", "--temperature", "-1"],
        "--temperature=-1.0 is not allowed",
    ),
    (
        "generate --threshold under --routing topk",
        ["generate", "--prompt", "x", "--threshold", "0.3"],
        "--threshold applies to --routing threshold",
    ),
    (
        "generate --threshold 1.5",
        ["generate", "--prompt", "x", "--routing", "threshold", "--threshold", "1.5"],
        "--threshold=1.5 is not allowed; allowed: a finite number in (0, 1]",
    ),
    (
        "generate --threshold nan",
        ["generate", "--prompt", "x", "--routing", "threshold", "--threshold", "nan"],
        "--threshold=nan",
    ),
    (
        "generate --greedy --temperature 0.5",
        ["generate", "--prompt", "x", "--greedy", "--temperature", "0.5"],
        "contradict",
    ),
    (
        "generate --seed -1",
        ["generate", "--prompt", "x", "--seed", "-1"],
        "--seed=-1 is not allowed; allowed: an integer in [0, 2**63 - 1]",
    ),
    (
        "generate --seed 2**63",
        ["generate", "--prompt", "x", "--seed", str(2**63)],
        "--seed=9223372036854775808",
    ),
    ("generate --top-p nan", ["generate", "--prompt", "x", "--top-p", "nan"], "--top-p=nan is not allowed"),
    (
        "generate --top-p 0",
        ["generate", "--prompt", "x", "--top-p", "0"],
        "--top-p=0.0 is not allowed; allowed: a finite number in (0, 1]",
    ),
    ("generate --top-p 1.5", ["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p=1.5"),
    (
        "generate --max-new-tokens 0",
        ["generate", "--prompt", "x", "--max-new-tokens", "0"],
        "--max-new-tokens=0 is not allowed; allowed: an integer in [1, 512]",
    ),
    (
        "generate --max-new-tokens 600",
        ["generate", "--prompt", "x", "--max-new-tokens", "600"],
        "--max-new-tokens=600",
    ),
    (
        "generate --backend triton (contiguous)",
        ["generate", "--prompt", "x", "--backend", "triton"],
        "add --cache paged",
    ),
    ("generate a 600-byte prompt", ["generate", "--prompt", "x" * 600], "600 tokens, more than"),
    (
        "generate prompt + new tokens past 512",
        ["generate", "--prompt", "x" * 500, "--max-new-tokens", "20"],
        "ask for at most 13 new tokens",
    ),
    (
        "generate --prompt ''",
        ["generate", "--prompt", ""],
        "--prompt='' is empty; allowed: at least one character",
    ),
    (
        "generate --prompt of a byte that is not UTF-8",
        ["generate", "--prompt", "ab\udcff"],  # how sys.argv holds the byte 0xff
        "--prompt is not UTF-8 text: at character 2, byte 0xff is not valid UTF-8; allowed: UTF-8 text",
    ),
    (
        "generate --max-new-tokens 1.5",
        ["generate", "--prompt", "x", "--max-new-tokens", "1.5"],
        "invalid int value: '1.5'",
    ),
    (
        "routing-stats --max-tokens 0",
        ["routing-stats", "--max-tokens", "0"],
        "--max-tokens=0 is not allowed; allowed: an integer >= 1",
    ),
    ("routing-stats --max-tokens -5", ["routing-stats", "--max-tokens", "-5"], "--max-tokens=-5"),
    (
        "routing-stats --threshold 0",
        ["routing-stats", "--routing", "threshold", "--threshold", "0"],
        "--threshold=0.0",
    ),
    (
        "bench memory --block-size 2**20",
        ["bench", "memory", "--block-size", str(2**20)],
        "--block-size=1048576 is not allowed; allowed: a power of two in [1, 256]",
    ),
    (
        "bench memory --block-size 12",
        ["bench", "memory", "--block-size", "12"],
        "--block-size=12 is not allowed",
    ),
    ("bench memory --block-size 0", ["bench", "memory", "--block-size", "0"], "--block-size=0"),
    (
        "bench memory --figures a file",
        ["bench", "memory", "--figures", A_FILE],
        f"--figures={A_FILE} is a file",
    ),
    (
        "bench memory --json a folder",
        ["bench", "memory", "--json", A_FOLDER],
        f"--json={A_FOLDER} is a folder",
    ),
    (
        "bench eviction --host-blocks -1",
        ["bench", "eviction", "--host-blocks", "-1"],
        "--host-blocks=-1 is not allowed; allowed: an integer in [0, 2**31 - 1] (0: recompute only",
    ),
    (
        "bench eviction --sequences 0",
        ["bench", "eviction", "--sequences", "0"],
        "--sequences=0 is not allowed; allowed: an integer >= 1",
    ),
    (
        "bench eviction --blocks-per-device 0",
        ["bench", "eviction", "--blocks-per-device", "0"],
        "--blocks-per-device=0 is not allowed; allowed: an integer >= 1",
    ),
    (
        "bench eviction --blocks-per-device 10 (no request fits)",
        ["bench", "eviction", "--blocks-per-device", "10"],
        "--blocks-per-device=10 is not allowed; allowed: an integer in [160, 2**29 - 1] "
        "(with fewer, none of the 48 requests",
    ),
    (
        "bench eviction --quick --sequences 8",
        ["bench", "eviction", "--quick", "--sequences", "8"],
        "--quick sets its own --sequences",
    ),
    (
        "bench eviction --only-prefix-cache --host-blocks 4",
        ["bench", "eviction", "--only-prefix-cache", "--host-blocks", "4"],
        "--host-blocks would be ignored",
    ),
    (
        "bench eviction --only-prefix-cache --skip-prefix-cache",
        ["bench", "eviction", "--only-prefix-cache", "--skip-prefix-cache"],
        "--skip-prefix-cache would be ignored",
    ),
    (
        "bench eviction --json in a folder that cannot be made",
        ["bench", "eviction", "--json", "/dev/null/runs/e.json"],
        "--json=/dev/null/runs/e.json: its folder /dev/null/runs cannot be made: /dev/null is a character "
        "device, not a directory",
    ),
    (
        "bench eviction --host-blocks 1.5",
        ["bench", "eviction", "--host-blocks", "1.5"],
        "invalid int value: '1.5'",
    ),
    (
        "bench serving --block-size 3",
        ["bench", "serving", "--block-size", "3"],
        "--block-size=3 is not allowed",
    ),
    (
        "bench serving --quick --num-requests 4",
        ["bench", "serving", "--quick", "--num-requests", "4"],
        "--quick sets its own",
    ),
    (
        "bench serving --num-requests 0",
        ["bench", "serving", "--num-requests", "0"],
        "--num-requests=0 is not allowed",
    ),
    (
        "bench serving --num-blocks 7",
        ["bench", "serving", "--num-blocks", "7"],
        "--num-blocks=7 is not allowed; allowed: an integer in [8, 2**31 - 1] "
        "(one token of one sequence takes 8 blocks)",
    ),
    ("bench serving --seed -1", ["bench", "serving", "--seed", "-1"], "--seed=-1"),
    (
        "bench serving --json in a folder that cannot be made",
        ["bench", "serving", "--json", "/dev/null/runs/s.json"],
        "cannot be made: /dev/null is a character device",
    ),
    (
        "bench step --rounds 0",
        ["bench", "step", "--rounds", "0"],
        "--rounds=0 is not allowed; allowed: an integer >= 1",
    ),
    ("bench step --num-seqs 0", ["bench", "step", "--num-seqs", "0"], "--num-seqs=0 is not allowed"),
    (
        "bench step --num-seqs 600",
        ["bench", "step", "--num-seqs", "600"],
        "--num-seqs=600 is not allowed; allowed: an integer in [1, 512]",
    ),
    (
        "bench step --max-new-tokens 1",
        ["bench", "step", "--max-new-tokens", "1"],
        "--max-new-tokens=1 is not allowed; allowed: an integer in [2, ",
    ),
    ("bench step --max-new-tokens 500", ["bench", "step", "--max-new-tokens", "500"], "--max-new-tokens=500"),
    (
        "bench step --against a folder without the package",
        ["bench", "step", "--against", "/"],
        "--against=/ has no moekv_ref package",
    ),
    (
        "demo --arrival-rate 0",
        ["demo", "--arrival-rate", "0"],
        "--arrival-rate=0.0 is not allowed; allowed: a finite number in (0, inf)",
    ),
    ("demo --arrival-rate nan", ["demo", "--arrival-rate", "nan"], "--arrival-rate=nan"),
    ("demo --arrival-rate inf", ["demo", "--arrival-rate", "inf"], "--arrival-rate=inf"),
    ("demo --num-requests 0", ["demo", "--num-requests", "0"], "--num-requests=0 is not allowed"),
    (
        "demo --num-blocks -1",
        ["demo", "--num-blocks", "-1"],
        "--num-blocks=-1 is not allowed; allowed: an integer in [8, 2**31 - 1]",
    ),
    ("demo --seed -2", ["demo", "--seed", "-2"], "--seed=-2"),
    ("demo --figures a file", ["demo", "--figures", A_FILE], f"--figures={A_FILE} is a file"),
    ("figures --out a file", ["figures", "--out", A_FILE], f"--out={A_FILE} is a file"),
    (
        "train-family --seeds 0 0",
        ["train-family", "--seeds", "0", "0"],
        "--seeds=0 0 is not allowed: 0 is given twice; allowed: distinct values",
    ),
    (
        "train-family --variants dense dense",
        ["train-family", "--variants", "dense", "expert_topk", "dense"],
        "--variants=dense expert_topk dense is not allowed: dense is given twice",
    ),
    (
        "capacity --seeds 1 2 1",
        ["capacity", "--seeds", "1", "2", "1"],
        "--seeds=1 2 1 is not allowed: 1 is given twice",
    ),
    ("capacity --variants dense dense", ["capacity", "--variants", "dense", "dense"], "dense is given twice"),
    (
        "bench cluster --rates 150 150.0",
        ["bench", "cluster", "--rates", "150", "150.0"],
        "--rates=150.0 150.0 is not allowed: 150.0 is given twice; allowed: distinct values",
    ),
    (
        "bench cluster --policies sequence_lru sequence_lru",
        ["bench", "cluster", "--policies", "sequence_lru", "sequence_lru"],
        "--policies=sequence_lru sequence_lru is not allowed",
    ),
    (
        "bench cluster --devices 8 8",
        ["bench", "cluster", "--devices", "8", "8"],
        "--devices=8 8 is not allowed",
    ),
    (
        "bench cluster --gib-per-device 1 1",
        ["bench", "cluster", "--gib-per-device", "1", "1"],
        "--gib-per-device=1.0 1.0 is not allowed",
    ),
    (
        "bench cluster --arrivals poisson poisson",
        ["bench", "cluster", "--arrivals", "poisson", "poisson"],
        "--arrivals=poisson poisson is not allowed",
    ),
    (
        "bench cluster --reservations twice",
        ["bench", "cluster", "--reservations", "optimistic", "optimistic"],
        "--reservations=optimistic optimistic is not allowed",
    ),
    (
        "bench simulator --scale --threads 0",
        ["bench", "simulator", "--scale", "--threads", "0"],
        "--threads=0 is not allowed",
    ),
]

# errors while a command runs: one line `error: ...`, status 2
CLI_CASES = [
    (
        "generate --checkpoint a directory",
        ["generate", "--prompt", "x", "--checkpoint", "/tmp"],
        "is a directory",
    ),
    (
        "generate --checkpoint missing",
        ["generate", "--prompt", "x", "--checkpoint", "/nonexistent.pt"],
        "does not exist",
    ),
    (
        "bench serving, every request refused",
        ["bench", "serving", "--num-blocks", "8", "--num-requests", "2"],
        "every request was refused",
    ),
]


def error_of(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("name,call,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_api_input_gets_a_clear_error(name, call, fragment):
    assert fragment in error_of(call)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every command (and the model loader) replaced by a failure: a bad option must stop first."""

    def ran(*args, **kwargs):
        raise AssertionError("the command ran although an option was bad")

    for module, name in (
        (cli, "cmd_generate"),
        (cli, "cmd_routing_stats"),
        (cli, "load_checkpoint"),
        (bench_eviction, "main"),
        (bench_memory, "run_bench_memory"),
        (bench_serving, "main"),
        (bench_step, "main"),
        (bench_cluster, "main"),
        (demo, "main"),
        (figures, "main"),
        (family, "main"),
        (capacity, "main"),
        (bench_peer, "main"),
        (bench_parallel, "main"),
    ):
        monkeypatch.setattr(module, name, ran)


@pytest.mark.parametrize("name,argv,fragment", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_bad_cli_option_is_a_parser_error_before_anything_runs(name, argv, fragment, capsys, nothing_runs):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # `python -m moekv_ref CMD: error: ...`
    assert exit_info.value.code == 2 and err.startswith("usage: python -m moekv_ref ")
    assert ": error: " in last and fragment in last and "Traceback" not in err


@pytest.mark.parametrize("name,argv,fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_cli_input_gets_a_clear_error(name, argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and "Traceback" not in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/null are POSIX's")
def test_a_path_option_names_a_symlink_loop_and_what_is_not_a_regular_file(tmp_path, capsys, nothing_runs):
    """Paths read by a command (a checkpoint, --against's checkout, the --json that --only-prefix-cache
    updates) are checked by one function: a loop of links is not "missing", a FIFO not "empty"."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    refused = [
        (["bench", "step", "--against", str(loop)], f"--against={loop} leads into a loop of symbolic links"),
        (
            ["bench", "step", "--against", str(fifo)],
            f"--against={fifo} is a FIFO (named pipe), not a directory",
        ),
        (
            ["bench", "simulator", "--against", os.devnull],
            f"--against={os.devnull} is a character device, not a directory",
        ),
        (
            ["bench", "eviction", "--only-prefix-cache", "--json", str(fifo)],
            f"--json={fifo} is a FIFO (named pipe), not a regular file",
        ),
        (
            ["bench", "eviction", "--only-prefix-cache", "--json", str(loop)],
            f"--json={loop} leads into a loop of symbolic links",
        ),
    ]
    for argv, fragment in refused:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and fragment in last, argv


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX's")
def test_a_checkpoint_option_names_a_symlink_loop_and_a_fifo(tmp_path, capsys):
    """--checkpoint is checked by the loader, the command's first step: `error: ...`, status 2."""
    loop = tmp_path / "loop.pt"
    loop.symlink_to(loop)
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    for path, fragment in ((loop, "leads into a loop of symbolic links"), (fifo, "is a FIFO (named pipe)")):
        assert main(["generate", "--prompt", "x", "--checkpoint", str(path)]) == 2
        assert f"error: checkpoint {str(path)!r} {fragment}" in capsys.readouterr().err


def can_create_in(folder) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder in which this process cannot create a file: a read-only temporary folder, or, for
    root (whom permission bits do not stop), sysfs's, which refuses new files to everyone."""
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        found = [f for f in (read_only, Path("/sys/kernel")) if f.is_dir() and not can_create_in(f)]
        if not found:
            pytest.skip("no folder here refuses new files to this user")
        yield found[0]
    finally:
        read_only.chmod(0o755)


OUTPUT_OPTIONS = [
    ["train-family", "--out", "{}/family.json"],
    ["train-family", "--out", "{}/made/family.json"],  # a folder train-family would make
    ["capacity", "--out", "{}/capacity.json"],
    ["bench", "memory", "--json", "{}/memory.json"],
    ["bench", "memory", "--figures", "{}/figures"],
    ["bench", "serving", "--json", "{}/serving.json"],
    ["bench", "eviction", "--json", "{}/eviction.json"],
    ["bench", "cluster", "--json", "{}/cluster.json"],
    ["bench", "step", "--json", "{}/step.json"],
    ["bench", "peer", "--json", "{}/peer.json"],
    ["bench", "parallel", "--json", "{}/parallel.json"],
    ["demo", "--figures", "{}"],
    ["figures", "--out", "{}/figures"],
]


@pytest.mark.parametrize(
    "argv", OUTPUT_OPTIONS, ids=[" ".join(a).replace("{}", "FOLDER") for a in OUTPUT_OPTIONS]
)
def test_an_output_this_user_cannot_write_is_refused_before_anything_runs(
    argv, unwritable_folder, capsys, nothing_runs
):
    argv = [*argv[:-1], argv[-1].format(unwritable_folder)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert (
        f"{argv[-2]}={argv[-1]}" in last and f"this user cannot create files in {unwritable_folder}" in last
    )


def test_train_checks_its_out_before_the_minutes_of_training(unwritable_folder, capsys, monkeypatch):
    def ran(*args, **kwargs):
        raise AssertionError("training started although --out cannot be written")

    monkeypatch.setattr(train, "train", ran)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--out", f"{unwritable_folder}/tiny.pt"])
    assert exit_info.value.code == 2 and "this user cannot create files in" in capsys.readouterr().err


def test_an_existing_output_this_user_cannot_write_is_refused(tmp_path, capsys, nothing_runs):
    out = tmp_path / "old.json"
    out.write_text("{}")
    out.chmod(0o444)
    try:
        with open(out, "a"):
            pytest.skip("this user writes a read-only file anyway (root)")
    except PermissionError:
        pass
    with pytest.raises(SystemExit):
        main(["bench", "serving", "--json", str(out)])
    assert f"--json={out} cannot be written (Permission denied)" in capsys.readouterr().err


def test_checking_outputs_leaves_their_folder_and_an_existing_file_as_they_were(tmp_path):
    """The checks create nothing that outlives them (a file without a name, or one removed at once)
    and open an existing file without truncating it."""
    old = tmp_path / "old.json"
    old.write_text("kept")
    before = old.stat().st_mtime_ns
    options.output_file("--json", str(tmp_path / "new.json"))
    options.output_file("--out", tmp_path / "made" / "family.json", parents_made=True)
    options.output_file("--json", str(old))
    options.folder("--figures", str(tmp_path / "figures"))
    options.folder("--figures", str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]
    assert old.read_text() == "kept" and old.stat().st_mtime_ns == before


def test_a_bench_module_run_alone_checks_its_options(capsys):
    """`python -m moekv_ref.apps.bench_memory` (and eviction, step) parse and check as the CLI does."""
    with pytest.raises(SystemExit) as exit_info:
        bench_memory.main(["--block-size", "12"])
    assert exit_info.value.code == 2 and "error: --block-size=12 is not allowed" in capsys.readouterr().err


def test_a_refused_option_writes_nothing(tmp_path, nothing_runs):
    out = tmp_path / "e.json"
    with pytest.raises(SystemExit):
        main(["bench", "eviction", "--host-blocks", "-1", "--json", str(out)])
    assert not out.exists() and list(tmp_path.iterdir()) == []


def pool_state(pool):
    return pool.free_block_ids(), pool.ref_cnt.clone(), pool.is_cached.clone(), pool.num_free_blocks


def caching_pool_in_use():
    """A CachingBlockPool of 8 blocks, 0..3 in use (block 1 twice)."""
    pool = CachingBlockPool(8)
    pool.incref(pool.allocate(4)[1:2])
    return pool


def same_state(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_refused_ids_and_counts_leave_the_pools_unchanged():
    pool = caching_pool_in_use()
    before = pool_state(pool)
    for call in (
        lambda: pool.free(torch.tensor([1.7])),
        lambda: pool.free([0, True]),
        lambda: pool.free("1"),
        lambda: pool.incref([1.5]),
        lambda: pool.mark_cached(torch.tensor([2.0])),
        lambda: pool.reuse(torch.tensor([2.0])),
        lambda: pool.allocate(2.0),
        lambda: pool.allocate(True),
    ):
        with pytest.raises(ValueError):
            call()
        assert same_state(before, pool_state(pool))
    pool.free(torch.tensor([1, 1]))  # integer ids still work, of any integer dtype
    pool.free(np.array([2], dtype=np.int32))
    pool.free([np.int64(3)])
    assert pool.num_free_blocks == 7
    pool.assert_consistent()

    device_pool = device_pool_in_use()
    before = device_pool.ref_cnt.clone(), device_pool.num_free_blocks_per_device
    for call in (
        lambda: device_pool.free(torch.tensor([3.0])),
        lambda: device_pool.incref([0.5]),
        lambda: device_pool.allocate(1, device=0.4),
        lambda: device_pool.allocate(1.0, device=0),
    ):
        with pytest.raises(ValueError):
            call()
        assert torch.equal(before[0], device_pool.ref_cnt) and torch.equal(
            before[1], device_pool.num_free_blocks_per_device
        )
    device_pool.assert_consistent()

    pools = pools_in_use()
    counts = pools.token_counts([7]).clone()
    free = pools.num_free_blocks_per_device
    for call in (
        lambda: pools.free_rows([0.0]),
        lambda: pools.allocate_slots(torch.tensor([0]), torch.tensor([1.5])),
        lambda: pools.allocate_slots(torch.tensor([0.0]), torch.tensor([1])),
    ):
        with pytest.raises(ValueError):
            call()
        assert torch.equal(counts, pools.token_counts([7])) and torch.equal(
            free, pools.num_free_blocks_per_device
        )
    pools.assert_consistent()


def test_per_device_inputs_that_are_integers_are_taken_as_they_are():
    """Lists, tuples, integer tensors and arrays, numpy integers: all the same pools and placement."""
    for blocks in (
        [40, 40],
        (40, 40),
        torch.tensor([40, 40]),
        np.array([40, 40], dtype=np.int32),
        [np.int64(40), np.int16(40)],
    ):
        assert check_blocks_per_device(blocks) == [40, 40]
        assert all(type(n) is int for n in check_blocks_per_device(blocks))
    expected = PLACEMENT.expand(2, -1)
    for placement in (
        PLACEMENT,
        PLACEMENT.to(torch.uint8),
        PLACEMENT.numpy(),
        PLACEMENT.tolist(),
        [[0, 0, 1, 1, 1]] * 2,
        [np.int64(d) for d in PLACEMENT.tolist()],
    ):
        assert torch.equal(checked_placement(placement, 2, 5, 2), expected)
    served = device_engine(np.array([40, 40]), PLACEMENT.numpy())
    assert served.blocks_per_device == [40, 40] and torch.equal(served.device_of_expert, expected)
    assert served.generate([[1, 2, 3]], [P4])[0].token_ids == generate(MODEL, [[1, 2, 3]], P4).tokens[0]


def test_a_refused_request_changes_nothing():
    served = engine(record_history=True)
    first = served.add_request([1, 2], P4)
    for prompt in ([], [1.5], "x", [1] * 200):
        with pytest.raises(ValueError):
            served.add_request(prompt, P4)
    assert list(served.requests) == [first] and len(served.scheduler.waiting) == 1
    assert [e.kind for e in served.events] == ["arrived"]


def test_generate_checks_each_prompt_against_its_own_limit():
    # 90 + 5 - 1 = 94 <= 96 positions; 2 + 50 - 1 = 51: both fit, although 90 + 50 would not
    prompts = [[1] * 90, [2, 3]]
    params = [
        SamplingParams(max_new_tokens=5, temperature=0),
        SamplingParams(max_new_tokens=50, temperature=0),
    ]
    result = generate(MODEL, prompts, params)
    assert [len(t) for t in result.tokens] == [5, 50]
    assert [o.token_ids for o in engine(num_blocks=4096).generate(prompts, params)] == result.tokens


def test_generate_takes_sampling_params_as_the_engine_does():
    # one check for both (prompts.check_batch): a dict of fields, or None for the defaults
    prompts = [[1, 2], [3]]
    as_dicts = generate(MODEL, prompts, [{"max_new_tokens": 3, "temperature": 0}, None])
    expected = generate(MODEL, prompts, [SamplingParams(max_new_tokens=3, temperature=0), SamplingParams()])
    assert as_dicts.tokens == expected.tokens
    assert [len(t) for t in as_dicts.tokens] == [3, SamplingParams().max_new_tokens]
    served = engine(num_blocks=4096).generate(prompts, [{"max_new_tokens": 3, "temperature": 0}, None])
    assert [o.token_ids for o in served] == expected.tokens


def test_paged_generate_sizes_its_pool_for_the_prompts_given():
    # sixteen 90-token prompts: a pool sized for eight sequences runs out of blocks in the prefill
    # (OutOfBlocksError with max_num_seqs=8); sized from the prompts given, it holds them all
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (90,), generator=generator).tolist() for _ in range(16)]
    params = SamplingParams(max_new_tokens=3, temperature=0)
    paged = generate(MODEL, prompts, params, cache="paged", block_size=16)
    assert paged.tokens == generate(MODEL, prompts, params, cache="contiguous").tokens


def test_a_budget_belongs_to_one_manager():
    """A RowBudget keeps one manager's rows: given to a second manager it is refused, naming it, and
    the first manager keeps it as it was."""
    budget = RowBudget(4)
    first = BudgetedKVCacheManager(2, 5, 2, 12, budget=budget)
    first.add_sequence(7)
    with pytest.raises(ValueError, match="budget=.* already belongs to another KVCacheManager"):
        BudgetedKVCacheManager(2, 5, 2, 12, budget=budget)
    assert budget.manager is first and first.holds(7)
    first.assert_consistent()


def test_each_variant_manager_takes_the_plain_managers_options():
    """Prefix caching, shared tails and a budget are managers of their own class; each takes the
    plain manager's options, checked by the same rules."""
    for make in (
        PrefixCachingKVCacheManager,
        SharedTailKVCacheManager,
        lambda *args, **options: BudgetedKVCacheManager(*args, budget=RowBudget(4), **options),
    ):
        manager = make(2, 5, 2, blocks_per_device=[6, 6], device_of_expert=PLACEMENT, shuffle_seed=1)
        assert manager.num_devices == 2 and manager.num_blocks == 12
        with pytest.raises(ValueError, match="block_size=3 is not allowed"):
            make(2, 5, 3, 12)


def test_allocate_slots_refuses_rows_of_no_held_sequence_and_changes_nothing():
    manager = manager_in_use()  # sequence 7 holds rows 0..9 (slot 0); rows 10..39 belong to no one
    free = manager.num_free_blocks
    for rows in ([12], [0, 12], [40]):
        with pytest.raises(ValueError, match="are not all rows of sequences the cache holds"):
            manager.allocate_slots(torch.tensor(rows), torch.ones(len(rows), dtype=torch.int64))
        assert manager.num_free_blocks == free and int(manager.row_tokens[10:].sum()) == 0
    manager.free(7)  # a freed sequence's rows are no one's either
    with pytest.raises(ValueError, match="rows \\[0\\] are not all rows"):
        manager.allocate_slots(torch.tensor([0]), torch.tensor([1]))
    manager.assert_consistent()


def test_integers_are_python_or_numpy_ints_everywhere():
    """np.int64 (any numpy integer) is an integer for every count, size and seed, as for ids and
    blocks_per_device: the same pools, caches and results as with Python ints."""
    served = LLMEngine(MODEL, np.int64(64), np.int64(4), shuffle_seed=np.int32(3))
    assert served.cache.manager.num_blocks == 64 and type(served.cache.block_size) is int
    expected = LLMEngine(MODEL, 64, 4, shuffle_seed=3)
    assert (
        served.generate([[1, 2, 3]], [P4])[0].token_ids == expected.generate([[1, 2, 3]], [P4])[0].token_ids
    )
    manager = KVCacheManager(np.int64(2), np.int64(5), np.int64(2), np.int64(12), shuffle_seed=np.int64(1))
    assert (manager.num_layers, manager.num_experts, manager.block_size, manager.num_blocks) == (2, 5, 2, 12)
    assert BlockPool(np.int16(8), shuffle_seed=np.int64(2)).num_blocks == 8
    config = ModelConfig(num_hidden_layers=np.int64(2), max_position_embeddings=np.int32(64))
    assert config.to_dict()["num_hidden_layers"] == 2 and type(config.max_position_embeddings) is int
    params = SamplingParams(max_new_tokens=np.int64(3), seed=np.uint8(5))
    assert (params.max_new_tokens, params.seed) == (3, 5) and type(params.seed) is int
    assert SchedulerConfig(max_num_seqs=np.int64(4)).max_num_seqs == 4
    assert RowBudget(np.int64(4), num_sinks=np.int64(1)).max_tokens == 4


def test_each_value_is_checked_once_per_public_entry(monkeypatch):
    """The engine's cache options are checked once, where it builds the cache: the cache, its manager
    and its pool trust what was checked (the frozen options object they are given); a manager built
    alone checks them itself, once too."""
    import moekv_ref

    calls = []

    def counting(module, name):
        checked = getattr(module, name)

        def check(*args, **kwargs):
            calls.append(name)
            return checked(*args, **kwargs)

        monkeypatch.setattr(module, name, check)

    names = ("check_block_size", "check_blocks_per_device", "check_seed")
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("moekv_ref.") and module is not moekv_ref.validation:
            for name in names:
                if hasattr(module, name):
                    counting(module, name)
    device_engine(shuffle_seed=3)
    assert sorted(calls) == ["check_block_size", "check_blocks_per_device", "check_seed"]
    calls.clear()
    KVCacheManager(2, 5, 2, shuffle_seed=1, blocks_per_device=[6, 6], device_of_expert=PLACEMENT)
    assert sorted(calls) == ["check_block_size", "check_blocks_per_device", "check_seed"]
    calls.clear()
    PagedKVCache(MODEL.config, 64, 4, shuffle_seed=1)
    assert sorted(calls) == ["check_block_size", "check_seed"]


@pytest.mark.skipif(memory_of("cpu") is None, reason="this machine does not tell its memory")
def test_a_pool_larger_than_the_machine_is_refused_before_it_is_allocated():
    """2**30 blocks are within what an int32 block table names, but their K/V are not within any test
    machine's memory: refused with the bytes they would take, not with the allocator's error."""
    with pytest.raises(
        ValueError, match=r"the K/V of 1,073,741,824 blocks of 4 tokens .* would take 1,024.0 GiB"
    ):
        engine(num_blocks=2**30)


@pytest.mark.skipif(
    memory_of("cpu") is None or memory_of("cpu") > 26 * 2**30, reason="a machine that holds 26 GiB"
)
def test_a_pool_whose_bookkeeping_outgrows_the_machine_is_refused():
    with pytest.raises(
        ValueError, match=r"bookkeeping of a pool of 2,147,483,647 blocks would take 26.0 GiB"
    ):
        BlockPool(2**31 - 1)


def test_paged_generate_of_a_model_with_huge_positions_is_refused_before_allocating():
    """max_position_embeddings=2**30 is a valid config, but the pool `generate(cache="paged")` sizes
    for it at its worst (without num_blocks) could not be allocated: refused, saying why."""
    model = random_model(small_config("expert", "topk", max_position_embeddings=2**30), seed=0)
    with pytest.raises(ValueError) as info:
        generate(model, [[1, 2]], P4, cache="paged")
    message = str(info.value)
    assert (
        "num_blocks=None sizes the pool for max_num_seqs=1 sequences of max_position_embeddings=1073741824"
        in message
    )
    assert "give num_blocks" in message
    assert (
        generate(model, [[1, 2]], P4, cache="paged", num_blocks=64).tokens
        == generate(model, [[1, 2]], P4).tokens
    )
