"""`python -m moekv_ref bench reservation [--seeds N] [--workers W] [--json PATH]`: how much does a
reservation that knows what it does not know serve, against worst case and against the bound?

Routed attention takes away what paged serving engines rely on: a step's KV demand is known only
after the routers decide. Four reservations of the one Scheduler (engine/reservation.py) meet the
same requests, in steady state, on the cluster of `bench cluster` (sim/cluster.py: an
expert-attention model of JetMoE-8B's size on 8 H200s, one group, E / D experts of every layer a
GPU; the cost model is costs.cluster_cost_model, the step waiting for its busiest GPU):

    worst_case    the most a step's tokens could take (no forward ever runs short)
    optimistic    decode tokens nothing, a chunk its expected blocks; a short step is undone
    calibrated    decode tokens their worst case, a chunk of at most 1,024 tokens its 0.99 quantile
                  per device; a short layer drops the chunk scheduled last (the others go on)
    clairvoyant   exactly what the trace will take (trace replay only): the bound

The question and the verdict, stated before the runs (PREREGISTERED, written into the JSON):

(R) Where worst case reaches at most 80% of clairvoyant goodput (the gate: without it, there is
    nothing for a better reservation to win), calibrated(0.99) reaches at least 95% of clairvoyant
    goodput (the 95% confidence interval of the paired ratio above 0.95), with faults on under 1%
    of steps and under 2% of the modelled time thrown away. If no setting passes the gate, the
    study says so. If calibrated does not beat worst case beyond its interval, worst case stays the
    default.

Design (one skew: the topic trace's topic_s = 1.5):
- Workload: 2,000 requests a run with the lengths of the Azure LLM conversation trace of 2023, cut
  to the model's 4,096 positions, Poisson arrivals; the first and last 10% of arrivals are left
  out of every measure (sim/steady_state.py's steady_window).
- Load: the rate as a utilization of the modelled capacity (steady_state.capacity: a saturated run
  with memory that never binds, seed 0's trace), 0.5, 0.7, 0.85 and 0.95.
- Memory: KV per GPU as multiples 0.5 and 1.0 of the working set at load 0.85 (steady_state's
  working_set: the most-used GPU's blocks in use, memory never binding, seed 0); both absolute
  values are written out.
- SLOs: TTFT 0.25 s (DistServe's chatbot SLO); TPOT scaled to the modelled step
  (steady_state.scaled_tpot_slo: 0.8 of the way from an idle step to a saturated one), so that it
  binds; both written out.
- Goodput as DistServe defines it: the highest rate at which at least 90% of the window's requests
  meet both SLOs (a refused or unfinished request does not), found by bisection over the rate
  (steady_state.goodput_by_bisection between loads 0.1 and 0.95, to 5%), per GPU. SLO attainment
  at the four loads beside it.
- Seeds: 10 (each its own trace and arrivals); every strategy sees the same trace and arrivals of
  a seed, so comparisons are paired by seed: the mean of per-seed ratios with a Student-t 95%
  interval, n stated.
- Victim: newest_first (vLLM's rule) for all.

Each (strategy, memory, seed) is one task: its four loads and its bisection, in a process of its
own (the standard library's process pool, --workers at once). Finished tasks are kept in the JSON
as they end, and a run given the same file takes up only the missing ones. The JSON records the
commit the runs came from; a tree with uncommitted changes is refused unless --allow-dirty (for
trying the program, never for results).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from functools import cache
from pathlib import Path

import torch
from tqdm import tqdm

from .. import jsonout
from ..config import get_config
from ..costs import cluster_cost_model
from ..engine.calibrated_reservation import CalibratedReservation
from ..sim.cluster import BLOCK_SIZE, MODEL, cluster_placement
from ..sim.runner import RunnerSetup, TraceRunner
from ..sim.steady_state import (
    TTFT_SLO,
    capacity,
    goodput_by_bisection,
    latency_arrays,
    scaled_tpot_slo,
    steady_window,
    trace_lengths,
    window_attainment,
    working_set,
)
from ..sim.workloads import arrival_times
from ..stats import mean_ci95
from ..validation import check_int
from . import options
from .bench_cluster import ACTIVE_PARAMS, cluster_workload

STRATEGIES = ("worst_case", "optimistic", "calibrated", "clairvoyant")
LOADS = (0.5, 0.7, 0.85, 0.95)  # utilization of the modelled capacity
MEMORY = (0.5, 1.0)  # KV per GPU, multiples of the working set at MEMORY_LOAD
MEMORY_LOAD = 0.85
NUM_DEVICES = 8
REQUESTS = 2000
SEEDS = 10
WORKLOAD = "azure_conversation_2023"
QUANTILE = 0.99  # calibrated(q)
MAX_CHUNK_TOKENS = 1024  # calibrated's cap on a prefill chunk
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
VICTIM = "newest_first"
TARGET = 0.9  # DistServe's attainment target
BISECTION_LOW = 0.1  # goodput's bisection starts between 0.1 and 0.95 of capacity
REL_TOL = 0.05  # goodput's bisection stops within 5%
MAX_EVALS = 8
PREREGISTERED = {
    "question": "Does calibrated(0.99) reservation serve close to the clairvoyant bound where worst "
    "case does not?",
    "gate": "worst case's mean goodput at most 80% of clairvoyant's (per memory setting)",
    "pass": "where the gate holds: calibrated(0.99) / clairvoyant goodput, paired by seed, with the "
    "95% CI's lower end above 0.95; faults on under 1% of steps; under 2% of modelled time thrown away",
    "otherwise": "if calibrated does not beat worst case beyond its CI, worst case stays the default",
    "seeds": SEEDS,
    "requests_per_run": REQUESTS,
    "stated_at_commit": "the commit that added this program",
}


@cache
def trace_of(seed: int, num_requests: int):
    """The routing trace of a seed (cached per process: every task of a seed reads it)."""
    return cluster_workload(num_requests, WORKLOAD, seed)


def base_setup(blocks_per_device: int) -> RunnerSetup:
    return RunnerSetup(
        blocks_per_device=blocks_per_device,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        admission="predicted",
    )


def cost_model():
    return cluster_cost_model(get_config(MODEL), ACTIVE_PARAMS, NUM_DEVICES, BLOCK_SIZE)


def reservation_of(strategy: str):
    """A fresh policy object for a run (calibrated learns from the requests it serves)."""
    if strategy == "calibrated":
        return CalibratedReservation(q=QUANTILE, max_chunk_tokens=MAX_CHUNK_TOKENS)
    return strategy


def calibrate(num_requests: int) -> dict:
    """Seed 0's capacity (load 1.0), working set at MEMORY_LOAD and the TPOT SLO: the study's scales."""
    trace = trace_of(0, num_requests)
    placement = cluster_placement(NUM_DEVICES)
    cost = cost_model()
    setup = base_setup(1)
    full = capacity(trace, placement, setup, cost)
    rate = full["requests_per_s"] * MEMORY_LOAD
    work = working_set(trace, placement, setup, cost, rate, seed=0)
    prompts, outputs = trace_lengths(trace)
    tpot = scaled_tpot_slo(cost, prompts, outputs, MAX_NUM_SEQS, hot_load=full["hot_load_in_window"])
    return {
        "capacity": full,
        "capacity_requests_per_s": full["requests_per_s"],
        "working_set": work,
        "working_set_blocks": work["blocks"],
        "ttft_slo_s": TTFT_SLO,
        "tpot_slo_s": tpot,
        "cost_model": cost.name,
    }


def run_at(strategy: str, blocks: int, seed: int, rate: float, scales: dict, num_requests: int) -> dict:
    """One run: the window's attainment and what the reservation cost."""
    trace = trace_of(seed, num_requests)
    setup = replace(base_setup(blocks), reservation=reservation_of(strategy))
    arrival = arrival_times(trace.num_sequences, rate, "poisson", seed=seed)
    started = time.perf_counter()
    runner = TraceRunner(trace, cluster_placement(NUM_DEVICES), setup, VICTIM, cost_model(), arrivals=arrival)
    stats = runner.run(10_000_000)
    window = steady_window(arrival)
    measured = window_attainment(*latency_arrays([stats]), scales["ttft_slo_s"], scales["tpot_slo_s"], window)
    return {
        "rate": rate,
        **measured,
        "steps": stats.num_steps,
        "modelled_seconds": stats.seconds,
        "faulted_steps": stats.num_faulted_steps,
        "retries": stats.num_retries,
        "repairs": stats.num_repairs,
        "thrown_away_seconds": stats.thrown_away_seconds,
        "thrown_away_token_layers": stats.thrown_away_token_layers,
        "preemptions": stats.num_evictions,
        "recomputed_tokens": stats.recomputed_tokens,
        "refused": stats.num_refused,
        "wall_seconds": time.perf_counter() - started,
    }


def task(strategy: str, memory: float, seed: int, scales: dict, num_requests: int) -> dict:
    """One (strategy, memory, seed): attainment at each load, then goodput by bisection (the loads'
    runs reused where the bisection asks for their rates)."""
    blocks = max(1, round(memory * scales["working_set_blocks"]))
    rate_of_load = scales["capacity_requests_per_s"]
    runs = {}

    def attainment_at(rate: float) -> float:
        if rate not in runs:
            runs[rate] = run_at(strategy, blocks, seed, rate, scales, num_requests)
        return runs[rate]["attainment"]

    loads = {}
    for load in LOADS:
        attainment_at(load * rate_of_load)
        loads[str(load)] = runs[load * rate_of_load]
    goodput = goodput_by_bisection(
        attainment_at,
        BISECTION_LOW * rate_of_load,
        LOADS[-1] * rate_of_load,
        TARGET,
        REL_TOL,
        MAX_EVALS,
        max_doublings=1,
    )
    every = list(runs.values())
    steps = sum(r["steps"] for r in every)
    return {
        "strategy": strategy,
        "memory": memory,
        "blocks_per_device": blocks,
        "seed": seed,
        "loads": loads,
        "goodput": goodput,
        "goodput_per_gpu": goodput["goodput"] / NUM_DEVICES,
        "fault_step_fraction": sum(r["faulted_steps"] for r in every) / max(1, steps),
        "thrown_away_fraction": sum(r["thrown_away_seconds"] for r in every)
        / max(1e-12, sum(r["modelled_seconds"] for r in every)),
        "bisection_runs": [runs[rate] for rate, _ in goodput["evaluations"]],
    }


def one_thread() -> None:
    """A worker computes on one core: --workers of them share the machine."""
    torch.set_num_threads(1)


def task_key(strategy: str, memory: float, seed: int) -> str:
    return f"{strategy}|{memory:g}|{seed}"


def paired(values: dict, over: dict) -> dict:
    """Per-seed ratios values[s] / over[s] (seed -> goodput), over the seeds in both with over[s] > 0:
    their mean with a Student-t 95% interval (stats.mean_ci95), n stated."""
    seeds = sorted(s for s in values if s in over and over[s] > 0)
    return mean_ci95([values[s] / over[s] for s in seeds])


def summarize(result: dict) -> dict:
    """Per memory: each strategy's goodput per GPU (mean over seeds), the paired ratios to
    clairvoyant and calibrated's to worst case, the fault and thrown-away fractions, and the verdict
    of (R) as PREREGISTERED says."""
    tasks = result["tasks"].values()
    summary = {}
    for memory in MEMORY:
        per = {
            strategy: {
                t["seed"]: t["goodput_per_gpu"]
                for t in tasks
                if t["strategy"] == strategy and t["memory"] == memory
            }
            for strategy in STRATEGIES
        }
        bound = per["clairvoyant"]
        rows = {}
        for strategy in STRATEGIES:
            chosen = [t for t in tasks if t["strategy"] == strategy and t["memory"] == memory]
            rows[strategy] = {
                "n": len(per[strategy]),
                "goodput_per_gpu_mean": statistics.fmean(per[strategy].values())
                if per[strategy]
                else float("nan"),
                "over_clairvoyant": paired(per[strategy], bound),
                "fault_step_fraction_max": max(
                    (t["fault_step_fraction"] for t in chosen), default=float("nan")
                ),
                "thrown_away_fraction_max": max(
                    (t["thrown_away_fraction"] for t in chosen), default=float("nan")
                ),
            }
        calibrated_over_worst = paired(per["calibrated"], per["worst_case"])
        gate = rows["worst_case"]["over_clairvoyant"]["mean"] <= 0.8
        calibrated = rows["calibrated"]
        passes = (
            calibrated["over_clairvoyant"]["ci95"][0] > 0.95
            and calibrated["fault_step_fraction_max"] < 0.01
            and calibrated["thrown_away_fraction_max"] < 0.02
        )
        summary[f"{memory:g}"] = {
            "strategies": rows,
            "calibrated_over_worst_case": calibrated_over_worst,
            "gate_binds": gate,
            "R_passes": passes if gate else None,
            "complete": all(rows[s]["n"] == result["seeds"] for s in STRATEGIES),
        }
    return summary


def build_parser(parser=None):
    parser = parser or argparse.ArgumentParser(prog="python -m moekv_ref bench reservation")
    parser.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds 0..N-1 (default {SEEDS})")
    parser.add_argument("--requests", type=int, default=REQUESTS, help=f"requests a run (default {REQUESTS})")
    parser.add_argument("--workers", type=int, default=2, help="processes at once (default 2)")
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES, help="(default: all four)"
    )
    parser.add_argument(
        "--json",
        default="runs/reservation_study.json",
        help="results, kept as tasks end (default %(default)s)",
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run from a tree with uncommitted changes (never for results)",
    )
    return parser


def check_args(args) -> None:
    for name, low, high in (("seeds", 1, 100), ("requests", 100, 100_000), ("workers", 1, 64)):
        check_int(f"--{name}", getattr(args, name), low, high)
    options.output_file("--json", args.json, parents_made=True)


def main(args) -> int:
    check_args(args)
    commit = jsonout.source_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise ValueError(
            f"the tree has uncommitted changes ({commit}): results must come from a commit; commit "
            "first, or give --allow-dirty to try the program"
        )
    path = Path(args.json)
    result = json.loads(path.read_text()) if path.exists() else {}
    settings = {"requests": args.requests, "seeds": args.seeds}
    if result and {k: result.get(k) for k in settings} != settings:
        raise ValueError(
            f"{path} holds a study of { ({k: result.get(k) for k in settings}) }, not {settings}"
        )
    if not result:
        started = time.perf_counter()
        result = {
            **settings,
            "preregistered": PREREGISTERED,
            "design": {
                "model": MODEL,
                "devices": NUM_DEVICES,
                "workload": WORKLOAD,
                "loads": LOADS,
                "memory_multiples": MEMORY,
                "memory_load": MEMORY_LOAD,
                "quantile": QUANTILE,
                "max_chunk_tokens": MAX_CHUNK_TOKENS,
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "victim": VICTIM,
                "warmup_cooldown": [0.1, 0.1],
                "topic_s": 1.5,
            },
            "scales": calibrate(args.requests),
            "tasks": {},
            "commits": [],
        }
        result["scales"]["wall_seconds"] = time.perf_counter() - started
    if commit not in result["commits"]:
        result["commits"].append(commit)
    todo = [
        (strategy, memory, seed)
        for seed in range(args.seeds)
        for memory in MEMORY
        for strategy in args.strategies
        if task_key(strategy, memory, seed) not in result["tasks"]
    ]
    print(
        f"capacity {result['scales']['capacity_requests_per_s']:.1f} requests/s, working set "
        f"{result['scales']['working_set_blocks']:.0f} blocks a GPU at load {MEMORY_LOAD}, TPOT SLO "
        f"{result['scales']['tpot_slo_s'] * 1e3:.1f} ms; {len(todo)} tasks to run"
    )
    jsonout.write(path, result, indent=1)
    # spawned, not forked: a process forked from one whose torch has started its threads can hang
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=spawn, initializer=one_thread) as pool:
        futures = {pool.submit(task, *key, result["scales"], args.requests): key for key in todo}
        for future in tqdm(as_completed(futures), total=len(futures), desc="tasks"):
            done = future.result()
            done["commit"] = commit
            result["tasks"][task_key(*futures[future])] = done
            result["summary"] = summarize(result)
            jsonout.write(path, result, indent=1)
    print_summary(result)
    return 0


def print_summary(result: dict) -> None:
    for memory, row in summarize(result).items():
        print(f"memory {memory} x working set: gate binds {row['gate_binds']}, (R) passes {row['R_passes']}")
        for strategy, numbers in row["strategies"].items():
            ratio = numbers["over_clairvoyant"]
            print(
                f"  {strategy:12s} n={numbers['n']:2d} goodput/GPU {numbers['goodput_per_gpu_mean']:7.2f} "
                f"x clairvoyant {ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] "
                f"faults {numbers['fault_step_fraction_max']:.4f} thrown {numbers['thrown_away_fraction_max']:.4f}"
            )
