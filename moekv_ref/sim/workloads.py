"""Workloads people serve: request lengths from published traces, arrivals in time, and the
latency a run gives them (TTFT, TPOT, goodput under SLOs).

Lengths come from data/serving_lengths.json: quantiles of prompt and output tokens of the Azure
LLM inference traces of 2023 (code and conversation, computed from the released files) and of
ShareGPT as Vidur uses it (median and p90; log-normal between). A length is drawn by inverse
transform, linear between quantiles.

Sessions (`sample_sessions`): multi-turn conversations, turns per session and each turn's new
prompt and output tokens drawn around the means LMSYS-Chat-1M publishes (the same file); each turn's
prompt is then the whole conversation so far (sim/traces.py, `conversation_turns`), and it arrives a
think time after the turn before it finished (sim/runner.py).

Arrivals: Poisson (exponential gaps), or bursty with gamma gaps of the same mean rate and a
coefficient of variation cv > 1 (cv = 1 is Poisson).

Latency, as DistServe (Zhong et al., OSDI 2024) defines it: TTFT is a request's first token time
minus its arrival; TPOT the mean time per output token after the first; a request is good when it
meets both SLOs, SLO attainment is the share of good requests, and goodput the highest request
rate whose attainment reaches a target (90% there). `latency_summary` gives one run's attainment
(never good requests over the run's length: refusing work shortens the run and would raise it);
bench cluster sweeps the rate to find goodput. `request_latencies`
and `meets_slos` are the per-request definitions it reads, as sim/steady_state.py's measurement over
a run's steady window does.

A decode-heavy workload (`decode_heavy_lengths`): short prompts, long log-normal outputs (its sigmas
are settings, not published numbers), where decoding fills the steps.

A skewed workload (`skewed_workload`, bench eviction's and notebooks 05 and 11's): a topic trace whose
popular topic's experts the co-activation placement puts together on one device, which fills first;
`workload_cost_model` is the projected H100 cost model at its shape.
"""

from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np
import torch

from ..costs import CostModel, projected_gpu_cost_model
from ..placement import place_layers
from ..validation import MAX_INT32, check_choice, check_int, check_real, check_seed
from .traces import topic_trace

ARRIVALS = ("poisson", "gamma")


def _lengths_file() -> dict:
    text = resources.files("moekv_ref").joinpath("data/serving_lengths.json").read_text()
    return json.loads(text)


def length_workloads() -> dict:
    """The published length statistics, by name (each with its `source`)."""
    return _lengths_file()["workloads"]


def session_workloads() -> dict:
    """The published multi-turn statistics, by name (each with its `source`)."""
    return _lengths_file()["sessions"]


def sample_sessions(
    name: str, num_sessions: int, seed: int = 0, max_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-turn sessions drawn around workload `name`'s means (session_workloads): (session,
    new prompt tokens, output tokens), (T,) int64 each, one entry per turn, a session's turns
    consecutive and in order. Turns per session are 1 + a geometric count (mean turns_mean), new
    prompt and output tokens log-normal (their means, `sigma`), all >= 1. With max_tokens, a
    session keeps only the turns whose whole conversation fits (its first turn cut to fit, as
    sample_lengths cuts)."""
    sessions = session_workloads()
    check_choice("workload", name, tuple(sessions))
    num_sessions = check_int("num_sessions", num_sessions, 1, MAX_INT32)
    if max_tokens is not None:
        max_tokens = check_int("max_tokens", max_tokens, 2, MAX_INT32)
    stats = sessions[name]
    generator = torch.Generator().manual_seed(seed)
    stop = 1.0 / stats["turns_mean"]  # a geometric count of mean 1 / p - 1 after the first turn
    u = torch.rand(num_sessions, generator=generator, dtype=torch.float64)
    extra = torch.floor(torch.log(u) / math.log1p(-stop)) if stop < 1 else torch.zeros_like(u)
    turns = 1 + extra.to(torch.int64)  # (sessions,)
    session = torch.repeat_interleave(torch.arange(num_sessions), turns)  # (T,)
    sigma = stats["sigma"]
    drawn = []
    for mean in (stats["prompt_mean"], stats["output_mean"]):
        mu = math.log(mean) - sigma**2 / 2
        normal = torch.randn(session.numel(), generator=generator, dtype=torch.float64)
        drawn.append(torch.exp(mu + sigma * normal).round().clamp(min=1).to(torch.int64))
    prompts, outputs = drawn
    if max_tokens is None:
        return session, prompts, outputs
    first = torch.ones_like(session, dtype=torch.bool)
    first[1:] = session[1:] != session[:-1]
    start = torch.nonzero(first).squeeze(1)  # (sessions,) each session's first turn
    conversation = (prompts + outputs).cumsum(0)
    conversation -= (conversation - prompts - outputs)[start].repeat_interleave(turns)  # per session
    keep = (conversation <= max_tokens) | first
    total = prompts + outputs
    over = first & (total > max_tokens)
    prompts = torch.where(over, (prompts * max_tokens // total).clamp(min=1), prompts)
    outputs = torch.where(over, (max_tokens - prompts).clamp(min=1), outputs)
    return session[keep], prompts[keep], outputs[keep]


def _quantiles(stats) -> torch.Tensor:
    """(q, 2) knots [p, tokens] of one length distribution, from a list of knots or a
    {median, p90} pair (log-normal through them, 0.1% to 99.9%)."""
    if isinstance(stats, list):
        return torch.tensor(stats, dtype=torch.float64)
    mu = math.log(stats["median"])
    z90 = 1.2815515655446004  # Phi^-1(0.9)
    sigma = (math.log(stats["p90"]) - mu) / z90
    p = torch.tensor([0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999], dtype=torch.float64)
    z = math.sqrt(2) * torch.erfinv(2 * p - 1)
    return torch.stack([p, torch.exp(mu + sigma * z)], 1)


def sample_lengths(
    name: str, num_requests: int, seed: int = 0, max_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts, outputs), (S,) int64 each, >= 1, drawn from workload `name`'s quantiles; with
    max_tokens, a request's prompt + output is cut to fit (the prompt first keeps its share)."""
    workloads = length_workloads()
    check_choice("workload", name, tuple(workloads))
    num_requests = check_int("num_requests", num_requests, 1, MAX_INT32)
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for part in ("prompt", "output"):
        knots = _quantiles(workloads[name][part])  # (q, 2)
        u = torch.rand(num_requests, generator=generator, dtype=torch.float64)  # (S,)
        i = torch.searchsorted(knots[:, 0].contiguous(), u).clamp(1, knots.shape[0] - 1)
        below = knots[i - 1]  # (S, 2) each
        above = knots[i]
        fraction = ((u - below[:, 0]) / (above[:, 0] - below[:, 0])).clamp(0, 1)
        value = below[:, 1] + (above[:, 1] - below[:, 1]) * fraction
        drawn.append(value.round().clamp(min=1).to(torch.int64))
    prompts, outputs = drawn
    if max_tokens is not None:
        prompts, outputs = cut_to_fit(prompts, outputs, max_tokens)
    return prompts, outputs


def cut_to_fit(
    prompts: torch.Tensor, outputs: torch.Tensor, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts, outputs) (S,) int64 with each request whose prompt + output exceeds max_tokens cut to
    fit: the prompt keeps its share of max_tokens (at least 1), the output the rest (at least 1)."""
    total = prompts + outputs
    over = total > max_tokens
    prompts = torch.where(over, (prompts * max_tokens // total).clamp(min=1), prompts)
    outputs = torch.where(over, (max_tokens - prompts).clamp(min=1), outputs)
    return prompts, outputs


# A decode-heavy workload's log-normal sigmas: settings, not published numbers (no published trace has
# this shape; reasoning models' long answers to short questions are the case it stands for)
DECODE_HEAVY_PROMPT_SIGMA = 0.3
DECODE_HEAVY_OUTPUT_SIGMA = 0.5


def decode_heavy_lengths(
    num_requests: int,
    seed: int = 0,
    max_tokens: int | None = None,
    mean_prompt: float = 200,
    mean_output: float = 3000,
    prompt_sigma: float = DECODE_HEAVY_PROMPT_SIGMA,
    output_sigma: float = DECODE_HEAVY_OUTPUT_SIGMA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts, outputs), (S,) int64 each, >= 1: short prompts and long outputs, where decoding, not
    prefill, fills the steps. Each is log-normal with the given mean (before any cut) and sigma (the
    log's standard deviation: settings, DECODE_HEAVY_*_SIGMA); with max_tokens, a request's
    prompt + output is cut to fit as `sample_lengths` cuts it (the prompt keeps its share), which
    lowers the outputs' mean where mean_output nears max_tokens."""
    num_requests = check_int("num_requests", num_requests, 1, MAX_INT32)
    seed = check_seed("seed", seed)
    if max_tokens is not None:
        max_tokens = check_int("max_tokens", max_tokens, 2, MAX_INT32, meaning="prompt + output tokens")
    for name, value in (("mean_prompt", mean_prompt), ("mean_output", mean_output)):
        check_real(name, value, 1, meaning="tokens")
    for name, value in (("prompt_sigma", prompt_sigma), ("output_sigma", output_sigma)):
        check_real(name, value, 0, 5, meaning="the log-normal's sigma")
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for mean, sigma in ((mean_prompt, prompt_sigma), (mean_output, output_sigma)):
        mu = math.log(mean) - sigma**2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
        normal = torch.randn(num_requests, generator=generator, dtype=torch.float64)
        drawn.append(torch.exp(mu + sigma * normal).round().clamp(min=1).to(torch.int64))
    prompts, outputs = drawn
    if max_tokens is not None:
        prompts, outputs = cut_to_fit(prompts, outputs, max_tokens)
    return prompts, outputs


def arrival_times(
    num_requests: int, rate: float, process: str = "poisson", cv: float = 2.0, seed: int = 0
) -> torch.Tensor:
    """(S,) float64 seconds, increasing from the first gap: `rate` requests per second on average,
    Poisson or gamma gaps with coefficient of variation cv (shape 1 / cv^2: bursts and lulls)."""
    check_choice("process", process, ARRIVALS)
    num_requests = check_int("num_requests", num_requests, 1, MAX_INT32)
    check_real("rate", rate, 0, low_open=True, meaning="requests per second")
    if process == "gamma":
        check_real("cv", cv, 0, low_open=True, meaning="the gaps' coefficient of variation")
    generator = torch.Generator().manual_seed(seed)
    if process == "poisson":
        gaps = torch.empty(num_requests, dtype=torch.float64).exponential_(rate, generator=generator)
    else:
        shape = 1.0 / cv**2  # mean shape * scale = 1 / rate
        # torch's gamma sampler takes no generator: numpy's seeded one draws the gaps
        gaps = torch.from_numpy(np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), num_requests))
    return torch.cumsum(gaps, 0)


def round_robin(arrival: torch.Tensor, num_groups: int) -> list[torch.Tensor]:
    """The requests each of num_groups serving groups gets from a dispatcher that hands arriving
    requests out in turn (the round-robin global scheduler of Vidur, Agrawal et al., MLSys 2024):
    group g serves the g-th, (g + G)-th, ... arrivals; each group's ids ascending. arrival (S,)."""
    num_groups = check_int("num_groups", num_groups, 1, MAX_INT32)
    order = torch.argsort(arrival, stable=True)  # (S,) arrival order
    return [order[g::num_groups].sort().values for g in range(num_groups)]


def session_arrivals(
    follows: torch.Tensor,
    rate: float,
    think_seconds: float,
    process: str = "poisson",
    cv: float = 2.0,
    seed: int = 0,
) -> torch.Tensor:
    """(T,) float64 for the turns of sessions (follows: sim/traces.py's conversation_turns): a
    session's first turn arrives as `arrival_times` gives them, `rate` sessions per second; each later
    turn gets its think time, exponential with mean think_seconds, counted from the turn before it
    finishing (TraceRunner's `follows`). LMSYS-Chat-1M publishes no think times: the mean is a
    setting to sweep, not a measured number."""
    check_real("think_seconds", think_seconds, 0, meaning="mean seconds between a turn's end and the next")
    first = follows < 0
    times = torch.zeros(follows.numel(), dtype=torch.float64)
    times[first] = arrival_times(int(first.sum()), rate, process, cv, seed)
    if think_seconds > 0:
        generator = torch.Generator().manual_seed(seed + 1)
        think = torch.empty(int((~first).sum()), dtype=torch.float64).exponential_(
            1.0 / think_seconds, generator=generator
        )
        times[~first] = think
    return times


def request_latencies(
    arrival: torch.Tensor, first_token: torch.Tensor, finish: torch.Tensor, num_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(TTFT, TPOT), (S,) float64 seconds each, as DistServe defines them, NaN for a request never
    served (finish NaN): TTFT is the first token's time minus the arrival; TPOT the time from the
    first token to the finish over the output tokens after the first (0 for a one-token output)."""
    served = ~torch.isnan(finish)
    ttft = first_token - arrival
    decode = finish - first_token
    tokens = num_output.to(torch.float64)
    tpot = torch.where(tokens > 1, decode / (tokens - 1).clamp(min=1), torch.zeros_like(decode))
    nan = torch.full_like(ttft, float("nan"))
    return torch.where(served, ttft, nan), torch.where(served, tpot, nan)


def meets_slos(ttft: torch.Tensor, tpot: torch.Tensor, ttft_slo: float, tpot_slo: float) -> torch.Tensor:
    """(S,) bool: the requests good under both SLOs; a NaN latency (never served) is never good."""
    return (ttft <= ttft_slo) & (tpot <= tpot_slo)


def latency_quantile(x: torch.Tensor, q: float) -> float:
    """The q-quantile of x (torch's linear interpolation), NaN for no values."""
    return float(torch.quantile(x, q)) if x.numel() else float("nan")


def latency_summary(
    arrival: torch.Tensor,
    first_token: torch.Tensor,
    finish: torch.Tensor,
    num_output: torch.Tensor,
    ttft_slo: float,
    tpot_slo: float,
) -> dict:
    """Per request (S,) arrival, first token and finish seconds (NaN: never served; an arrival NaN:
    a session's turn that never came, its turn before refused) and output tokens: TTFT and TPOT at
    p50 and p99 over served requests, and SLO attainment over all (a request never served counts as
    not good)."""
    served = ~torch.isnan(finish)
    every_ttft, every_tpot = request_latencies(arrival, first_token, finish, num_output)
    ttft = every_ttft[served]
    tpot = every_tpot[served]
    good = meets_slos(ttft, tpot, ttft_slo, tpot_slo)
    return {
        "served": int(served.sum()),
        "requests": int(arrival.numel()),
        "ttft_p50_s": latency_quantile(ttft, 0.5),
        "ttft_p99_s": latency_quantile(ttft, 0.99),
        "tpot_p50_s": latency_quantile(tpot, 0.5),
        "tpot_p99_s": latency_quantile(tpot, 0.99),
        "ttft_slo_s": ttft_slo,
        "tpot_slo_s": tpot_slo,
        "slo_attainment": float(good.sum()) / max(1, arrival.numel()),
    }


# ----- a skewed workload on per-device pools (bench eviction, notebooks 05 and 11) ------------------
def skewed_workload(
    num_sequences: int = 48,
    num_layers: int = 8,
    num_experts: int = 16,
    top_k: int = 2,
    num_devices: int = 4,
    mean_prompt: float = 128,
    mean_output: float = 128,
    topic_s: float = 1.5,
    seed: int = 0,
    placement: str = "coactivation",
):
    """The trace and the placement: per-sequence topics (sim/traces.py: topic_trace), experts placed by
    co-activation, which puts the popular topic's experts together on device 0 (it fills first).
    KV per (layer, expert) slot: 2 KV heads of 128 in bf16 (1 KiB)."""
    trace, topic = topic_trace(
        num_sequences,
        num_layers,
        num_experts,
        top_k,
        topic_s=topic_s,
        mean_prompt=mean_prompt,
        mean_output=mean_output,
        kv_bytes_per_slot=1024,
        seed=seed,
    )
    selected = [
        torch.nn.functional.one_hot(trace.experts[:, layer].long(), num_experts).sum(1).bool()
        for layer in range(num_layers)
    ]
    return trace, topic, place_layers(selected, num_devices, placement)


def workload_cost_model(trace, block_size: int, host_link: str = "pcie_gen5_x16") -> CostModel:
    """The projected H100 cost model at the skewed workload's shape (2 B active parameters, 4 query
    heads of 128 per expert), swapping over `host_link` (a name in costs.HOST_LINKS)."""
    return projected_gpu_cost_model(
        2e9,
        trace.kv_bytes_per_slot,
        trace.num_layers,
        int(trace.experts.shape[2]),
        trace.num_experts,
        128,
        4,
        block_size,
        host_link=host_link,
    )
