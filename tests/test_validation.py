"""Bad input, through the API and the command line: every case gets one clear ValueError (or, on the
command line, exit status 2 and one line `error: ...`) naming the bad value and what is allowed,
before any state changes. And two valid inputs that used to be refused or to fail: per-prompt limits
in `generate`, and a paged `generate` of more prompts than the default pool was sized for.

The case list is data (CASES, CLI_CASES): the closing table of bad inputs is printed from it.
"""

import math

import pytest
import torch

from moekv_ref.apps.cli import main
from moekv_ref.config import ModelConfig
from moekv_ref.engine import LLMEngine, SchedulerConfig, generate_with_engine
from moekv_ref.engine.workload import make_workload
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams

from helpers import random_model, small_config

MODEL = random_model(small_config("expert", "threshold"), seed=0)        # vocab 64, 96 positions
P4 = SamplingParams(max_new_tokens=4)


def engine(**options):
    return LLMEngine(MODEL, **{"num_blocks": 64, "block_size": 4, **options})


# (what is tried, the call, a fragment the error must contain)
CASES = [
    ("temperature=1e-320", lambda: SamplingParams(temperature=1e-320), "too small to sample with"),
    ("temperature=inf", lambda: SamplingParams(temperature=math.inf), "temperature=inf must be >= 0"),
    ("temperature=nan", lambda: SamplingParams(temperature=math.nan), "temperature=nan"),
    ("temperature='1'", lambda: SamplingParams(temperature="1"), "temperature='1'"),
    ("temperature=-0.5", lambda: SamplingParams(temperature=-0.5), "temperature=-0.5 must be >= 0"),
    ("top_p=nan", lambda: SamplingParams(top_p=math.nan), "top_p=nan must be in (0, 1]"),
    ("top_p=0", lambda: SamplingParams(top_p=0), "top_p=0 must be in (0, 1]"),
    ("max_new_tokens=2.0", lambda: SamplingParams(max_new_tokens=2.0), "max_new_tokens=2.0 must be an integer"),
    ("max_new_tokens=True", lambda: SamplingParams(max_new_tokens=True), "max_new_tokens=True"),
    ("seed=-1", lambda: SamplingParams(seed=-1), "seed=-1 must be an integer in [0, 2**63 - 1]"),
    ("seed=1.5", lambda: SamplingParams(seed=1.5), "seed=1.5"),
    ("LLMEngine num_blocks=200.0", lambda: engine(num_blocks=200.0), "num_blocks=200.0 must be an integer >= 1"),
    ("LLMEngine num_blocks=0", lambda: engine(num_blocks=0), "num_blocks=0 must be an integer >= 1"),
    ("LLMEngine num_blocks=True", lambda: engine(num_blocks=True), "num_blocks=True"),
    ("LLMEngine num_blocks=4 (< one token)", lambda: engine(num_blocks=4), "too small for even one sequence"),
    ("LLMEngine block_size=0", lambda: engine(block_size=0), "block_size=0 is not allowed"),
    ("LLMEngine block_size=3", lambda: engine(block_size=3), "power of two"),
    ("LLMEngine num_swap_blocks=-1", lambda: engine(num_swap_blocks=-1), "num_swap_blocks=-1"),
    ("num_swap_blocks under recompute", lambda: engine(num_swap_blocks=8),
     "applies to preemption_mode='swap', not 'recompute'"),
    ("LLMEngine attention='fast'", lambda: engine(attention="fast"), "attention='fast' is not one of"),
    ("scheduler_config as a dict", lambda: engine(scheduler_config={"max_num_seqs": 4}), "must be a SchedulerConfig"),
    ("LLMEngine model='tiny'", lambda: LLMEngine("tiny", 64), "model must be a MoEKVTransformer"),
    ("LLMEngine shuffle_seed=-3", lambda: engine(shuffle_seed=-3), "shuffle_seed=-3"),
    ("LLMEngine record_history='yes'", lambda: engine(record_history="yes"), "record_history='yes'"),
    ("SchedulerConfig max_num_seqs=0", lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs=0 must be an integer >= 1"),
    ("SchedulerConfig max_num_batched_tokens=2.5", lambda: SchedulerConfig(max_num_batched_tokens=2.5),
     "max_num_batched_tokens=2.5"),
    ("SchedulerConfig policy='fifo'", lambda: SchedulerConfig(policy="fifo"), "policy='fifo' is not one of"),
    ("SchedulerConfig admission='lucky'", lambda: SchedulerConfig(admission="lucky"), "admission='lucky'"),
    ("SchedulerConfig preemption_mode='evict'", lambda: SchedulerConfig(preemption_mode="evict"), "preemption_mode='evict'"),
    ("SchedulerConfig victim='random'", lambda: SchedulerConfig(victim="random"), "victim='random'"),
    ("admission under policy='static'", lambda: SchedulerConfig(policy="static", admission="optimistic"),
     "applies to policy='continuous_paged' only"),
    ("swap with no swap space", lambda: engine(scheduler_config=SchedulerConfig(preemption_mode="swap"),
                                               num_swap_blocks=0), "needs a swap space"),
    ("add_request prompt []", lambda: engine().add_request([], P4), "is empty"),
    ("add_request float token ids", lambda: engine().add_request([1.0, 2.0], P4), "token 0 is 1.0 (float)"),
    ("add_request bool token id", lambda: engine().add_request([1, True], P4), "token 1 is True"),
    ("add_request token 64 (vocab 64)", lambda: engine().add_request([1, 64], P4), "outside the vocabulary [0, 64)"),
    ("add_request token -1", lambda: engine().add_request([-1], P4), "token 0 is -1, outside"),
    ("add_request a str prompt", lambda: engine().add_request("hello", P4), "is text (str)"),
    ("add_request float tensor", lambda: engine().add_request(torch.tensor([1.0, 2.0]), P4), "1-D integer tensor"),
    ("add_request 2-D tensor", lambda: engine().add_request(torch.tensor([[1, 2]]), P4), "1-D integer tensor"),
    ("add_request prompt=5", lambda: engine().add_request(5, P4), "must be a sequence of token ids"),
    ("add_request prompt over max positions", lambda: engine(num_blocks=4096).add_request([1] * 200, P4),
     "has 200 tokens, more than the model's max_position_embeddings=96"),
    ("add_request prompt + max_new_tokens over positions",
     lambda: engine(num_blocks=4096).add_request([1] * 90, SamplingParams(max_new_tokens=10)),
     "ask for at most 7 new tokens"),
    ("add_request unknown sampling key", lambda: engine().add_request([1], {"temprature": 1.0}), "allowed keys"),
    ("add_request sampling_params='greedy'", lambda: engine().add_request([1], "greedy"),
     "must be a SamplingParams or a dict"),
    ("add_request that can never fit", lambda: engine(num_blocks=40).add_request([5] * 80, SamplingParams(max_new_tokens=10)),
     "can never fit in the pool of 40 blocks"),
    ("engine.generate([])", lambda: engine().generate([]), "no prompts given"),
    ("engine.generate('abc')", lambda: engine().generate("abc"), "prompts must be a list"),
    ("engine.generate params count", lambda: engine().generate([[1], [2]], [P4]), "got 1 sampling params for 2 prompts"),
    ("engine.generate bad prompt 1", lambda: engine().generate([[1], [2.5]], P4), "prompt 1: token 0 is 2.5"),
    ("abort_request(99) unknown", lambda: engine().abort_request(99), "request_id=99 is not a request of this engine"),
    ("abort_request('0')", lambda: engine().abort_request("0"), "request_id='0'"),
    ("generate(model, [])", lambda: generate(MODEL, []), "non-empty list of prompts"),
    ("generate cache='mmap'", lambda: generate(MODEL, [[1, 2]], cache="mmap"), "unknown cache kind 'mmap'"),
    ("generate block_size with contiguous", lambda: generate(MODEL, [[1, 2]], P4, cache="contiguous", block_size=4),
     "apply to cache='paged' only"),
    ("generate float token", lambda: generate(MODEL, [[1, 2.5]], P4), "token 1 is 2.5"),
    ("generate params as a dict", lambda: generate(MODEL, [[1]], {"max_new_tokens": 2}), "params[0] must be a SamplingParams"),
    ("generate over-long prompt + tokens", lambda: generate(MODEL, [[1] * 96], SamplingParams(max_new_tokens=5)),
     "ask for at most 1 new tokens"),
    ("generate_with_engine block_size=0", lambda: generate_with_engine(MODEL, [[1]], P4, block_size=0), "block_size=0"),
    ("generate_with_engine no prompts", lambda: generate_with_engine(MODEL, [], P4), "non-empty list"),
    ("ModelConfig rope_theta=nan", lambda: ModelConfig(rope_theta=math.nan), "rope_theta=nan is not allowed"),
    ("ModelConfig rms_norm_eps=-1", lambda: ModelConfig(rms_norm_eps=-1), "rms_norm_eps=-1 must be in (0, 1)"),
    ("ModelConfig rms_norm_eps=inf", lambda: ModelConfig(rms_norm_eps=math.inf), "rms_norm_eps=inf"),
    ("ModelConfig routing_threshold=nan", lambda: ModelConfig(routing_threshold=math.nan), "routing_threshold=nan"),
    ("ModelConfig hidden_size=128.0", lambda: ModelConfig(hidden_size=128.0), "hidden_size=128.0 is not allowed"),
    ("ModelConfig kv_lora_rank=1.5", lambda: ModelConfig(kv_lora_rank=1.5), "kv_lora_rank=1.5"),
    ("ModelConfig.from_dict([1, 2])", lambda: ModelConfig.from_dict([1, 2]), "must be a dict of fields"),
    ("make_workload(0)", lambda: make_workload(0), "num_requests=0"),
    ("make_workload arrival_rate=inf", lambda: make_workload(4, arrival_rate=math.inf), "arrival_rate=inf"),
    ("make_workload prompt_len=(5, 2)", lambda: make_workload(4, prompt_len=(5, 2)), "prompt_len=(5, 2)"),
    ("make_workload temperature=-1", lambda: make_workload(4, temperature=-1), "temperature=-1"),
]

CLI_CASES = [
    ("generate --cache paged --block-size 0", ["generate", "--prompt", "x", "--cache", "paged", "--block-size", "0"],
     "block_size=0 is not allowed"),
    ("generate --block-size 4 (contiguous)", ["generate", "--prompt", "x", "--block-size", "4"],
     "--block-size applies to --cache paged"),
    ("generate --temperature inf", ["generate", "--prompt", "x", "--temperature", "inf"], "temperature=inf"),
    ("generate --temperature 1e-320", ["generate", "--prompt", "x", "--temperature", "1e-320"], "too small"),
    ("generate --threshold under --routing topk", ["generate", "--prompt", "x", "--threshold", "0.3"],
     "--threshold applies to --routing threshold"),
    ("generate --threshold 1.5", ["generate", "--prompt", "x", "--routing", "threshold", "--threshold", "1.5"],
     "must be a probability mass in (0, 1]"),
    ("generate --greedy --temperature 0.5", ["generate", "--prompt", "x", "--greedy", "--temperature", "0.5"],
     "contradict"),
    ("generate --seed -1", ["generate", "--prompt", "x", "--seed", "-1"], "seed=-1"),
    ("generate --top-p nan", ["generate", "--prompt", "x", "--top-p", "nan"], "top_p=nan"),
    ("generate --max-new-tokens 0", ["generate", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens=0"),
    ("generate --backend triton (contiguous)", ["generate", "--prompt", "x", "--backend", "triton"], "add --cache paged"),
    ("generate --checkpoint a directory", ["generate", "--prompt", "x", "--checkpoint", "/tmp"], "is a directory"),
    ("generate --checkpoint missing", ["generate", "--prompt", "x", "--checkpoint", "/nonexistent.pt"], "does not exist"),
    ("generate a 600-byte prompt", ["generate", "--prompt", "x" * 600], "600 tokens, more than"),
    ("generate --prompt ''", ["generate", "--prompt", ""], "the prompt is empty"),
    ("routing-stats --max-tokens 0", ["routing-stats", "--max-tokens", "0"], "--max-tokens 0 must be at least 1"),
    ("routing-stats --max-tokens -5", ["routing-stats", "--max-tokens", "-5"], "--max-tokens -5 must be at least 1"),
    ("bench serving, every request refused", ["bench", "serving", "--num-blocks", "8", "--num-requests", "2"],
     "every request was refused"),
    ("bench serving --block-size 3", ["bench", "serving", "--block-size", "3"], "block_size=3"),
    ("bench serving --quick --num-requests 4", ["bench", "serving", "--quick", "--num-requests", "4"],
     "--quick sets its own"),
    ("bench serving --num-requests 0", ["bench", "serving", "--num-requests", "0"], "--num-requests 0"),
    ("demo --arrival-rate 0", ["demo", "--arrival-rate", "0"], "--arrival-rate 0.0 must be"),
    ("demo --arrival-rate nan", ["demo", "--arrival-rate", "nan"], "--arrival-rate nan"),
    ("demo --num-requests 0", ["demo", "--num-requests", "0"], "--num-requests 0"),
    ("demo --num-blocks -1", ["demo", "--num-blocks", "-1"], "--num-blocks -1"),
]


def error_of(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("name,call,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_api_input_gets_a_clear_error(name, call, fragment):
    assert fragment in error_of(call)


@pytest.mark.parametrize("name,argv,fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_cli_input_gets_a_clear_error(name, argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and "Traceback" not in err


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
    params = [SamplingParams(max_new_tokens=5, temperature=0), SamplingParams(max_new_tokens=50, temperature=0)]
    result = generate(MODEL, prompts, params)
    assert [len(t) for t in result.tokens] == [5, 50]
    assert [o.token_ids for o in engine(num_blocks=4096).generate(prompts, params)] == result.tokens


def test_paged_generate_sizes_its_pool_for_the_prompts_given():
    # sixteen 90-token prompts: a pool sized for eight sequences runs out of blocks in the prefill
    # (OutOfBlocksError with max_num_seqs=8); sized from the prompts given, it holds them all
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (90,), generator=generator).tolist() for _ in range(16)]
    params = SamplingParams(max_new_tokens=3, temperature=0)
    paged = generate(MODEL, prompts, params, cache="paged", block_size=16)
    assert paged.tokens == generate(MODEL, prompts, params, cache="contiguous").tokens
