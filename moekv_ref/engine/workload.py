"""Workloads: requests with prompt lengths, output lengths and arrival times, and serving one.

Time is counted in engine steps, not seconds, so that a run is the same on every machine: a request
arriving at step s is added before step s runs. Arrivals are a Poisson process of `arrival_rate`
requests per step (None: everything arrives at step 0, the offline setting of the benchmark).

Prompts are slices of one fixed text (data/prompt.py.txt), as bytes: the embedded model is
byte-level and was trained on Python source, so it continues these sensibly. Lengths are log-uniform between the given
bounds: many short requests and a few long ones, the spread that makes static batching pad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..prompts import encode
from ..sampling import SamplingParams
from ..validation import MAX_INT32, a_type, check_int, check_real, check_seed, shown
from .engine import LLMEngine
from .request import RequestOutput

# a few-shot workload's prompts start with FEW_SHOT_TEXT (an instruction and worked examples);
# both texts are data, kept as files like the held-out text
_DATA = Path(__file__).parent.parent / "data"
PROMPT_TEXT = (_DATA / "prompt.py.txt").read_text(encoding="utf-8")
FEW_SHOT_TEXT = (_DATA / "few_shot.py.txt").read_text(encoding="utf-8")


@dataclass
class WorkloadRequest:
    arrival_step: int
    prompt: list[int]
    sampling_params: SamplingParams


def _log_uniform(low: int, high: int, generator: torch.Generator) -> int:
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))


def _check_arrivals_and_sampling(arrival_rate, temperature: float, top_p: float) -> None:
    check_real("arrival_rate", arrival_rate, 0, low_open=True, meaning="requests per step", allow_none=True)
    SamplingParams(temperature=temperature, top_p=top_p)  # checks both before any work


def make_workload(
    num_requests: int = 24,
    prompt_len: tuple[int, int] = (8, 192),
    output_len: tuple[int, int] = (8, 128),
    arrival_rate: float | None = None,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int = 0,
    vocab_size: int = 256,
) -> list[WorkloadRequest]:
    """`num_requests` requests, lengths and arrivals as the module docstring says. Request i samples
    with seed seed + i. Token ids are bytes, folded modulo `vocab_size` for smaller vocabularies (tests)."""
    num_requests = check_int("num_requests", num_requests, 1, MAX_INT32)
    for name, bounds in (("prompt_len", prompt_len), ("output_len", output_len)):
        allowed = "two integers (low, high) with 1 <= low <= high"
        if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2):
            raise ValueError(f"{name}={shown(bounds)} is {a_type(bounds)}; allowed: {allowed}")
        low = check_int(f"{name}[0]", bounds[0], 1, MAX_INT32)
        high = check_int(f"{name}[1]", bounds[1], 1, MAX_INT32)
        if low > high:
            raise ValueError(f"{name}={shown(bounds)} is not allowed; allowed: {allowed}")
    seed = check_seed("seed", seed, num_requests)  # request i samples with seed + i
    check_int("vocab_size", vocab_size, 1, MAX_INT32)
    _check_arrivals_and_sampling(arrival_rate, temperature, top_p)
    text = [t % vocab_size for t in encode(PROMPT_TEXT)]
    generator = torch.Generator().manual_seed(seed)
    requests, clock = [], 0.0
    for i in range(num_requests):
        length = min(_log_uniform(*prompt_len, generator), len(text))
        start = int(torch.randint(0, len(text) - length + 1, (), generator=generator))
        num_new = _log_uniform(*output_len, generator)
        if arrival_rate is not None and i > 0:
            clock += float(
                torch.empty((), dtype=torch.float64).exponential_(arrival_rate, generator=generator)
            )
        params = SamplingParams(max_new_tokens=num_new, temperature=temperature, top_p=top_p, seed=seed + i)
        requests.append(WorkloadRequest(int(clock), text[start : start + length], params))
    return requests


def few_shot_workload(
    num_requests: int = 16,
    prompt_len: int = 256,
    shared_share: float = 0.875,
    output_len: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    arrival_rate: float | None = None,
    seed: int = 0,
    vocab_size: int = 256,
) -> list[WorkloadRequest]:
    """Requests sharing a long prefix, as few-shot prompting makes them: the first
    round(shared_share * prompt_len) of each prompt's prompt_len tokens are FEW_SHOT_TEXT, the rest
    a slice of PROMPT_TEXT at a seeded position, different per request. Greedy by default; seeds and
    arrivals as make_workload."""
    for name, value in (
        ("num_requests", num_requests),
        ("prompt_len", prompt_len),
        ("output_len", output_len),
        ("vocab_size", vocab_size),
    ):
        check_int(name, value, 1, MAX_INT32)
    check_seed("seed", seed, num_requests)  # request i samples with seed + i
    text = [t % vocab_size for t in encode(FEW_SHOT_TEXT)]
    own_text = [t % vocab_size for t in encode(PROMPT_TEXT)]
    check_real("shared_share", shared_share, 0, 1, meaning="the shared part of each prompt")
    shared_len = round(shared_share * prompt_len)
    own_len = prompt_len - shared_len
    if shared_len > len(text) or own_len > len(own_text):
        raise ValueError(
            f"prompt_len={prompt_len} with shared_share={shared_share} needs {shared_len} shared tokens "
            f"(at most {len(text)}) and {own_len} own (at most {len(own_text)})"
        )
    _check_arrivals_and_sampling(arrival_rate, temperature, top_p)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randperm(len(own_text) - own_len + 1, generator=generator)[:num_requests].tolist()
    requests, clock = [], 0.0
    for i in range(num_requests):
        start = starts[i % len(starts)]
        if arrival_rate is not None and i > 0:
            clock += float(
                torch.empty((), dtype=torch.float64).exponential_(arrival_rate, generator=generator)
            )
        params = SamplingParams(
            max_new_tokens=output_len, temperature=temperature, top_p=top_p, seed=seed + i
        )
        requests.append(
            WorkloadRequest(int(clock), text[:shared_len] + own_text[start : start + own_len], params)
        )
    return requests


@dataclass
class WorkloadResult:
    outputs: dict[int, RequestOutput]  # by position in the workload
    refused: dict[int, str] = field(default_factory=dict)  # position -> the error add_request gave


def run_workload(
    engine: LLMEngine, workload: list[WorkloadRequest], on_step: Callable[[LLMEngine], None] | None = None
) -> WorkloadResult:
    """Add each request when its arrival step comes, step until everything is served. A request that
    add_request refuses is recorded with its error and the others are served."""
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_step)
    ids: dict[int, int] = {}
    refused: dict[int, str] = {}
    finished: dict[int, RequestOutput] = {}  # by request id
    next_index = 0
    while next_index < len(order) or engine.has_unfinished_requests():
        while next_index < len(order) and workload[order[next_index]].arrival_step <= engine.step_count:
            i = order[next_index]
            try:
                ids[i] = engine.add_request(workload[i].prompt, workload[i].sampling_params)
            except ValueError as error:
                refused[i] = str(error)
            next_index += 1
        if engine.has_unfinished_requests():
            finished.update((output.request_id, output) for output in engine.step())
        elif next_index < len(order):
            engine.idle_step()
        if on_step is not None:
            on_step(engine)
    return WorkloadResult({i: finished[rid] for i, rid in ids.items()}, refused)
