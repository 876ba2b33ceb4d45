"""Steady-state measurement of a serving run: what a study of load, memory and policy measures, and
how it sets the load and the memory it measures at.

A run of a few hundred requests is mostly transient: the first requests find an empty system, the
last ones a draining one. So:

- `steady_window` marks the requests measured: by arrival order, the first `warmup` and the last
  `cooldown` fractions are left out (they still run, and load the system the measured ones see).
- `window_attainment` is SLO attainment over the window only, with TTFT and TPOT as DistServe
  (Zhong et al., OSDI 2024) defines them (sim/workloads.py's `request_latencies`, the same ones
  `latency_summary` reads). A request refused or never finished counts as measured and not good:
  refusing work lowers attainment, never raises it. Nothing here divides by a makespan.
- `goodput_by_bisection` is DistServe's goodput: the highest request rate whose attainment reaches
  the target (90%), found by bisection over the rate (attainment assumed to fall as the rate grows).
- `capacity_rate` is the load a study calls 1.0: requests per second of a saturated system (every
  request waiting at t = 0) whose memory never binds, over its steady part. A study sets
  rate = utilization x capacity.
- `working_set_blocks` is the most-used device's blocks in use, in the steady window of a run at a
  rate with memory that never binds: the memory that load needs, so a study can give each GPU
  multiples of it.
- `scaled_tpot_slo` is a TPOT SLO scaled to the modelled step time, between an idle system's step
  and a saturated one's (DistServe's 0.1 s is 20 times the p99 TPOT of the cluster model, so it
  never binds); TTFT keeps DistServe's 0.25 s (TTFT_SLO): it binds through queueing, which grows
  without bound once the rate passes capacity.

Memory that never binds (`ample_blocks_per_device`): every running request can hold at most its
worst case (each of its tokens' k experts placed on one device, every row's last block partly
empty), and at most setup.max_num_seqs run at once, so max_num_seqs times the longest request's
worst case on its worst device holds any batch the scheduler can form; nothing is refused,
preempted or retried (the runs check it, and raise if not).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable

import torch

from ..costs import CostModel
from ..engine.demand import worst_case_lifetime_blocks_per_device
from ..validation import (
    MAX_BLOCKS,
    MAX_INT32,
    check_callable,
    check_device_table,
    check_int,
    check_real,
    check_seed,
)
from .runner import RunnerSetup, RunnerStats, TraceRunner
from .traces import RoutingTrace
from .workloads import arrival_times, latency_quantile, meets_slos, request_latencies

# DistServe's chatbot TTFT SLO (Zhong et al., OSDI 2024, Table 1): kept, since queueing past capacity
# makes TTFT grow without bound, so it binds under overload whatever the step time
TTFT_SLO = 0.25
# A TPOT SLO this fraction of the way from an idle system's step to a saturated one's (`scaled_tpot_slo`)
TPOT_SLO_FACTOR = 0.8
WARMUP = 0.1  # the share of arrivals left out at the start of a run
COOLDOWN = 0.1  # and at its end
STEADY_COMPLETIONS = (0.1, 0.9)  # capacity: throughput between these completion points
MAX_STEPS = 10_000_000  # a run's step limit (bench cluster's)


def steady_window(arrival: torch.Tensor, warmup: float = WARMUP, cooldown: float = COOLDOWN) -> torch.Tensor:
    """(S,) bool: the requests measured. Of the n requests that arrived (arrival not NaN: a session's
    turn that never came is not measured), ordered by arrival (ties by index), the first
    floor(warmup * n) and the last floor(cooldown * n) are left out."""
    arrival = _seconds_tensor("arrival", arrival)
    warmup = check_real("warmup", warmup, 0, 1, high_open=True, meaning="a fraction of the arrivals")
    cooldown = check_real("cooldown", cooldown, 0, 1, high_open=True, meaning="a fraction of the arrivals")
    if warmup + cooldown >= 1:
        raise ValueError(
            f"warmup + cooldown={warmup + cooldown:g} is not allowed; allowed: a sum below 1 "
            f"(warmup={warmup:g}, cooldown={cooldown:g} would leave no request measured)"
        )
    arrived = torch.nonzero(~torch.isnan(arrival)).squeeze(1)  # (n,)
    order = arrived[torch.argsort(arrival[arrived], stable=True)]  # (n,) by arrival
    n = order.numel()
    window = torch.zeros(arrival.numel(), dtype=torch.bool)
    window[order[math.floor(warmup * n) : n - math.floor(cooldown * n)]] = True
    return window


def latency_arrays(runs: list[RunnerStats]) -> tuple[torch.Tensor, ...]:
    """(arrival, first_token, finish, num_output), (S,) each, over runs side by side (groups of GPUs
    each serving its own requests): what `window_attainment` and `steady_window` take."""
    names = ("arrival_seconds", "first_token_seconds", "finish_seconds", "num_output_tokens")
    return tuple(torch.cat([getattr(stats, name) for stats in runs]) for name in names)


def window_attainment(
    arrival: torch.Tensor,
    first_token: torch.Tensor,
    finish: torch.Tensor,
    num_output: torch.Tensor,
    ttft_slo: float,
    tpot_slo: float,
    window: torch.Tensor,
) -> dict:
    """SLO attainment over the window's requests (window (S,) bool, `steady_window`): measured (the
    window's requests), served (finished), good (served and within both SLOs), attainment = good /
    measured (a refused or unfinished request is measured and not good), and TTFT and TPOT p50 and
    p99 over the window's served requests. Per request (S,) arrival, first token and finish seconds
    (NaN: never happened) and output tokens, as RunnerStats holds them (`latency_arrays` joins runs)."""
    arrival = _seconds_tensor("arrival", arrival)
    S = arrival.numel()
    first_token = _seconds_tensor("first_token", first_token, S)
    finish = _seconds_tensor("finish", finish, S)
    num_output = torch.as_tensor(num_output)
    if num_output.shape != (S,) or num_output.dtype.is_floating_point or num_output.dtype == torch.bool:
        raise ValueError(
            f"num_output has shape {tuple(num_output.shape)} and dtype {num_output.dtype}; allowed: ({S},) integers"
        )
    check_real("ttft_slo", ttft_slo, 0, low_open=True, meaning="seconds")
    check_real("tpot_slo", tpot_slo, 0, low_open=True, meaning="seconds")
    window = torch.as_tensor(window)
    if window.shape != (S,) or window.dtype != torch.bool:
        raise ValueError(
            f"window has shape {tuple(window.shape)} and dtype {window.dtype}; allowed: ({S},) bool (steady_window)"
        )
    ttft, tpot = request_latencies(arrival, first_token, finish, num_output)
    good = meets_slos(ttft, tpot, ttft_slo, tpot_slo) & window  # NaN (never served) is not good
    served = window & ~torch.isnan(finish)
    measured = int(window.sum())
    arrivals = arrival[window]
    return {
        "measured": measured,
        "served": int(served.sum()),
        "good": int(good.sum()),
        "attainment": float(good.sum()) / measured if measured else float("nan"),
        "ttft_p50_s": latency_quantile(ttft[served], 0.5),
        "ttft_p99_s": latency_quantile(ttft[served], 0.99),
        "tpot_p50_s": latency_quantile(tpot[served], 0.5),
        "tpot_p99_s": latency_quantile(tpot[served], 0.99),
        "ttft_slo_s": ttft_slo,
        "tpot_slo_s": tpot_slo,
        # the window's arrivals span: measured / this is the rate offered to the window
        "window_seconds": float(arrivals.max() - arrivals.min()) if measured else float("nan"),
    }


def goodput_by_bisection(
    attainment_at: Callable[[float], float],
    low: float,
    high: float,
    target: float = 0.9,
    rel_tol: float = 0.02,
    max_evals: int = 12,
    max_doublings: int = 4,
) -> dict:
    """DistServe's goodput: the highest rate (requests per second) whose attainment_at(rate) reaches
    `target`, attainment assumed to fall as the rate grows. attainment_at(low) is evaluated first:
    below target, the goodput is 0 (status "fails_at_low"). Then high; while it meets the target,
    high doubles (at most max_doublings times; status "meets_at_high" with the goodput the highest
    rate tried if it still meets, a lower bound). Then bisection between the highest passing and
    the lowest failing rate until they are within rel_tol of the passing one (status "converged")
    or max_evals evaluations are spent ("max_evals"). The goodput is always a rate that passed,
    never one merely evaluated last. Returns {"goodput", "bracket": [passing, failing] (failing None
    where none failed),
    "evaluations": [[rate, attainment], ...] in order, "target", "doublings", "status"}."""
    check_callable("attainment_at", attainment_at, "a rate in requests per second", allow_none=False)
    check_real("low", low, 0, low_open=True, meaning="requests per second")
    check_real("high", high, low, low_open=True, meaning=f"requests per second, above low={low:g}")
    check_real("target", target, 0, 1, low_open=True, meaning="the attainment a rate must reach")
    check_real(
        "rel_tol",
        rel_tol,
        0,
        1,
        low_open=True,
        high_open=True,
        meaning="the bracket's width over its low end",
    )
    max_evals = check_int("max_evals", max_evals, 2, 1000, meaning="evaluations of attainment_at")
    max_doublings = check_int("max_doublings", max_doublings, 0, 64)
    evaluations = []

    def passes(rate: float) -> bool:
        attainment = attainment_at(rate)
        if not isinstance(attainment, (int, float)) or not 0 <= attainment <= 1:  # NaN fails both
            raise ValueError(f"attainment_at({rate:g}) returned {attainment!r}; allowed: a number in [0, 1]")
        evaluations.append([float(rate), float(attainment)])
        return attainment >= target

    def result(goodput: float, bracket: list, status: str) -> dict:
        return {
            "goodput": goodput,
            "bracket": bracket,
            "evaluations": evaluations,
            "target": target,
            "doublings": doublings,
            "status": status,
        }

    doublings = 0
    if not passes(low):
        return result(0.0, [0.0, float(low)], "fails_at_low")
    lo = float(low)
    hi = float(high)
    while passes(hi):
        lo = hi
        if doublings == max_doublings or len(evaluations) == max_evals:
            return result(lo, [lo, None], "meets_at_high")  # no failing rate found
        hi *= 2
        doublings += 1
    while hi - lo > rel_tol * lo:
        if len(evaluations) == max_evals:
            return result(lo, [lo, hi], "max_evals")
        middle = (lo + hi) / 2
        if passes(middle):
            lo = middle
        else:
            hi = middle
    return result(lo, [lo, hi], "converged")


def interpolated_goodput(evaluations: list, target: float = 0.9) -> float:
    """The rate where attainment crosses `target`, read by a straight line between the highest
    passing rate and the lowest failing rate above it among `evaluations` ([[rate, attainment], ...],
    as goodput_by_bisection returns them). The bisection's own goodput is the bracket's low end, so
    two policies a bracket apart differ by a whole tolerance even when their attainments at the
    bracket's ends are close; the crossing resolves them within the bracket. With no failing rate
    above the highest passing one, that rate; with none passing, 0."""
    check_real("target", target, 0, 1, low_open=True, meaning="the attainment a rate must reach")
    passing = [rate for rate, attainment in evaluations if attainment >= target]
    if not passing:
        return 0.0
    lo = max(passing)
    above = [(rate, attainment) for rate, attainment in evaluations if rate > lo and attainment < target]
    if not above:
        return float(lo)
    hi, hi_attainment = min(above)
    lo_attainment = max(attainment for rate, attainment in evaluations if rate == lo)
    fraction = (lo_attainment - target) / (lo_attainment - hi_attainment)
    return float(lo + fraction * (hi - lo))


def ample_blocks_per_device(trace: RoutingTrace, device_of_expert, setup: RunnerSetup) -> int:
    """Blocks per device that never bind (module docstring): setup.max_num_seqs times the most
    blocks the longest request of the trace can hold on any one device."""
    table = check_device_table(
        device_of_expert, MAX_BLOCKS, trace.num_layers, trace.num_experts, every_layer=True
    )  # (L, E)
    num_devices = int(table.max()) + 1
    longest = trace.lengths.max().reshape(1)  # (1,) cached tokens
    worst = worst_case_lifetime_blocks_per_device(
        longest, trace.k_max, setup.block_size, table.unsqueeze(0), num_devices
    )  # (1, D)
    blocks = setup.max_num_seqs * int(worst.max())
    if blocks * num_devices > MAX_BLOCKS:
        raise ValueError(
            f"memory that never binds needs {blocks} blocks on each of {num_devices} devices, past "
            f"{MAX_BLOCKS} in all: lower max_num_seqs={setup.max_num_seqs} or the longest request"
        )
    return blocks


def _ample_run(trace, device_of_expert, setup, cost, arrivals) -> tuple[RunnerStats, list, list, int]:
    """One run with memory that never binds: (stats, finished after each step, each step's hot load
    (the runner's: D x the busiest device's share of the step's work), blocks per device);
    RuntimeError if anything was refused, preempted or retried all the same."""
    blocks = ample_blocks_per_device(trace, device_of_expert, setup)
    ample = replace(setup, blocks_per_device=blocks)
    finished = []
    # the victim policy never acts (nothing is preempted): any would do
    runner = TraceRunner(trace, device_of_expert, ample, "sequence_lru", cost, arrivals=arrivals)
    hot_loads = []

    def after_step(num_finished: int) -> None:
        finished.append(num_finished)
        hot_loads.append(runner.hot_load)

    stats = runner.run(MAX_STEPS, on_step=after_step)
    if (
        stats.num_refused
        or stats.num_victim_sequences
        or stats.num_retries
        or stats.num_finished < trace.num_sequences
    ):
        raise RuntimeError(
            f"with {blocks} blocks per device (memory that should never bind) the run refused "
            f"{stats.num_refused}, preempted {stats.num_victim_sequences}, retried {stats.num_retries} "
            f"and finished {stats.num_finished} of {trace.num_sequences} requests"
        )
    return stats, finished, hot_loads, blocks


def capacity(trace: RoutingTrace, device_of_expert, setup: RunnerSetup, cost: CostModel) -> dict:
    """The modelled capacity (`capacity_rate`) and how it was measured: requests per second between
    the 10% and 90% completion points of a run with every request waiting at t = 0 and memory that
    never binds. Also: the blocks per device given, the completion points (their ranks and
    seconds), the mean running and hot load over the steps between them, and saturated_until, the share of
    requests finished when the last one was admitted (the batch can stay full only until then: a
    window ending past it counts some of the drain, so give the trace many more requests than
    max_num_seqs)."""
    _check_cost(cost)
    started = time.perf_counter()
    stats, finished, hot_loads, blocks = _ample_run(trace, device_of_expert, setup, cost, arrivals=None)
    wall = time.perf_counter() - started
    n = trace.num_sequences
    times = torch.sort(stats.finish_seconds).values  # (n,) completion times
    first = math.ceil(STEADY_COMPLETIONS[0] * n)  # ranks, 1-based
    last = math.ceil(STEADY_COMPLETIONS[1] * n)
    seconds = float(times[last - 1] - times[first - 1]) if last > first else 0.0
    if seconds <= 0:
        raise ValueError(
            f"the trace's {n} requests leave no time between the {first}-th and {last}-th completions; "
            "allowed: a trace of more requests (many more than max_num_seqs)"
        )
    done = torch.tensor(finished)  # (steps,) finished after each step
    steps = (done >= first) & (done < last)
    admitted = [step for step, _, kind in stats.events if kind == "admitted"]
    return {
        "requests_per_s": (last - first) / seconds,
        "blocks_per_device": blocks,
        "completions": [first, last],
        "completion_seconds": [float(times[first - 1]), float(times[last - 1])],
        "mean_running_in_window": float(stats.num_running[steps].double().mean()) if steps.any() else 0.0,
        # the work's multiplier a saturated step pays (`scaled_tpot_slo`'s hot_load)
        "hot_load_in_window": float(torch.tensor(hot_loads)[steps].mean()) if steps.any() else 1.0,
        "max_num_seqs": setup.max_num_seqs,
        "saturated_until": (finished[max(admitted)] / n) if admitted else 0.0,
        "modelled_seconds": stats.seconds,
        "wall_seconds": wall,
    }


def capacity_rate(trace: RoutingTrace, device_of_expert, setup: RunnerSetup, cost: CostModel) -> float:
    """Requests per second of a saturated system whose memory never binds, over its steady part: load
    1.0 (`capacity` says how it was measured)."""
    return capacity(trace, device_of_expert, setup, cost)["requests_per_s"]


def working_set(
    trace: RoutingTrace,
    device_of_expert,
    setup: RunnerSetup,
    cost: CostModel,
    rate: float,
    seed: int = 0,
    warmup: float = WARMUP,
    cooldown: float = COOLDOWN,
) -> dict:
    """The working set at `rate` (`working_set_blocks`) and the run's numbers: Poisson arrivals at
    rate (seeded by seed), memory that never binds; the steady window's steps are those from the
    admission of its first request to the admission of its last (with memory that never binds, a
    request waits only for a free one of max_num_seqs); over them, the mean of the most-used
    device's blocks in use (per step, the fullest device), each device's mean, the mean running
    and hot load, and the window's latencies (TTFT and TPOT p50 and p99)."""
    _check_cost(cost)
    check_real("rate", rate, 0, low_open=True, meaning="requests per second")
    seed = check_seed("seed", seed)
    started = time.perf_counter()
    arrival = arrival_times(trace.num_sequences, rate, "poisson", seed=seed)
    window = steady_window(arrival, warmup, cooldown)
    stats, _, hot_loads, blocks = _ample_run(trace, device_of_expert, setup, cost, arrivals=arrival)
    wall = time.perf_counter() - started
    admitted = [step for step, request, kind in stats.events if kind == "admitted" and bool(window[request])]
    steps = slice(min(admitted), max(admitted) + 1)
    used = stats.used_blocks[steps].double()  # (steps, D)
    ttft, tpot = request_latencies(*latency_arrays([stats]))
    latency = {
        f"{name}_p{q}_s": latency_quantile(values[window], q / 100)
        for name, values in (("ttft", ttft), ("tpot", tpot))
        for q in (50, 99)
    }
    return {
        "blocks": float(used.max(1).values.mean()),
        "blocks_per_device_mean": used.mean(0).tolist(),
        "mean_running": float(stats.num_running[steps].double().mean()),
        "hot_load": float(torch.tensor(hot_loads)[steps].mean()),
        "steps": used.shape[0],
        "rate": rate,
        "ample_blocks_per_device": blocks,
        **latency,  # over the window's requests (all finish: memory never binds)
        "modelled_seconds": stats.seconds,
        "wall_seconds": wall,
    }


def working_set_blocks(
    trace: RoutingTrace, device_of_expert, setup: RunnerSetup, cost: CostModel, rate: float, seed: int = 0
) -> float:
    """The expected working set at `rate`, in blocks: the mean, over the steady window's steps, of the
    most-used device's blocks in use, with memory that never binds (`working_set` says how)."""
    return working_set(trace, device_of_expert, setup, cost, rate, seed)["blocks"]


def saturated_step_seconds(
    cost: CostModel, prompts: torch.Tensor, outputs: torch.Tensor, batch_size: int, hot_load: float = 1.0
) -> float:
    """The modelled time of one step of a steady batch of batch_size decoding requests of these
    lengths ((S,) prompt and output tokens): CostModel.step_fixed_seconds of the step's tokens plus
    batch_size times the work per decode token, which is the workload's decode work (each decode
    token over its context) and its prefill work (each prompt once: the requests replacing the
    finished ones) over its decode tokens. The step's tokens are batch_size decode tokens and the
    prompt tokens that come with them (batch_size times all prompt tokens over all decode tokens).
    hot_load: what the step's work is multiplied by, as the trace runner multiplies it: the busiest
    device's share of the step's (token, layer, expert) entries times D (1: spread evenly; the
    cost model splits the work evenly and a step waits for its busiest device).
    TPOT (the time from the first token to the last over the tokens after the first) is the mean
    time of the steps a request decodes in, so a request decoding in such a batch sees this."""
    _check_cost(cost)
    prompts, outputs = _check_lengths(prompts, outputs)
    batch_size = check_int("batch_size", batch_size, 1, MAX_INT32, meaning="requests decoding together")
    check_real("hot_load", hot_load, 1, meaning="D x the busiest device's share of a step's work")
    decode_tokens = (outputs - 1).clamp(min=0)  # the first output token comes from the prefill
    num_decode = float(decode_tokens.sum())
    if num_decode == 0:
        raise ValueError("outputs are all 1 token: no decode step to scale a TPOT SLO to")
    prompts = prompts.to(torch.float64)
    # a request's decode tokens see contexts prompt .. prompt + output - 2: decode_seconds is affine
    # in the context, so their sum is their count times decode_seconds of the mean context
    mean_context = prompts + (decode_tokens.to(torch.float64) - 1).clamp(min=0) / 2
    decode = float((decode_tokens * cost.decode_seconds(mean_context)).sum())
    prefill = float(cost.recompute_seconds(prompts).sum())
    step_tokens = round(batch_size * (1 + float(prompts.sum()) / num_decode))
    return cost.step_fixed_seconds(step_tokens) + hot_load * batch_size * (decode + prefill) / num_decode


def scaled_tpot_slo(
    cost: CostModel,
    prompts: torch.Tensor,
    outputs: torch.Tensor,
    batch_size: int,
    factor: float = TPOT_SLO_FACTOR,
    hot_load: float = 1.0,
) -> float:
    """A TPOT SLO `factor` of the way from the step of one decoding request to the step of a
    saturated batch (`saturated_step_seconds` at 1 and at batch_size: the batch the system holds
    when saturated, max_num_seqs where memory does not bind it, else the batch memory allows):
    idle + factor * (saturated - idle), factor in (0, 1); hot_load as `saturated_step_seconds` takes it
    (a saturated run's mean, or 1 for routing spread evenly).

    Why it binds when overloaded and is met at low load: past capacity the waiting line never
    empties, the batch stays full, and every step costs about the saturated step, above the SLO
    for factor < 1. At low load a request decodes in a batch of a few, each step about the idle
    step, below the SLO for factor > 0, however large the step's fixed cost. A step's time grows
    about linearly with its batch, so a request misses the SLO when the batch it decoded in was,
    on average over its life, more than about `factor` full: by Little's law (batch = rate x time
    in the system) that happens as the rate nears capacity, the nearer the larger the fixed cost
    is against a full batch's work. (DistServe's 0.1 s is about 20 times the p99 TPOT of bench
    cluster's runs: it binds at no load.)"""
    check_real(
        "factor", factor, 0, 1, low_open=True, high_open=True, meaning="of the way from idle to saturated"
    )
    idle = saturated_step_seconds(cost, prompts, outputs, 1, hot_load)
    saturated = saturated_step_seconds(cost, prompts, outputs, batch_size, hot_load)
    return idle + factor * (saturated - idle)


def trace_lengths(trace: RoutingTrace) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts, outputs) (S,) int64 of a trace's requests, as the runner serves them (a trace stores
    every token but the last sampled one)."""
    return trace.prompt_lens, trace.lengths - trace.prompt_lens + 1


def _check_lengths(prompts, outputs) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = torch.as_tensor(prompts)
    outputs = torch.as_tensor(outputs)
    for name, value in (("prompts", prompts), ("outputs", outputs)):
        if (
            value.dim() != 1
            or value.numel() == 0
            or value.dtype.is_floating_point
            or value.dtype == torch.bool
        ):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} and dtype {value.dtype}; allowed: (S,) integers, S >= 1"
            )
        if int(value.min()) < 1:
            raise ValueError(f"{name} holds {int(value.min())}; allowed: tokens >= 1")
    if prompts.shape != outputs.shape:
        raise ValueError(
            f"prompts {tuple(prompts.shape)} and outputs {tuple(outputs.shape)}: allowed: the same shape"
        )
    return prompts, outputs


def _seconds_tensor(name: str, value, size: int | None = None) -> torch.Tensor:
    """A (S,) float64 tensor of seconds (NaN allowed: never happened)."""
    tensor = torch.as_tensor(value)
    if (
        tensor.dim() != 1
        or not tensor.dtype.is_floating_point
        or (size is not None and tensor.numel() != size)
    ):
        shape = "(S,)" if size is None else f"({size},)"
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; allowed: {shape} float seconds"
        )
    return tensor.to(torch.float64)


def _check_cost(cost) -> None:
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost={cost!r:.60} is not a CostModel; allowed: a CostModel (costs.py)")
