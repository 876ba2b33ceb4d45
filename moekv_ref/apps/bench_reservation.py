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
- Memory: KV per GPU as multiples 0.125, 0.5 and 1.0 of the working set at load 0.85
  (steady_state's working_set: the most-used GPU's blocks in use, memory never binding, seed 0);
  both absolute values are written out. 0.125 was added after the first four seeds showed the gate
  open at 0.5 and 1.0: a pilot of worst case and clairvoyant alone (seed 0; calibrated not run)
  found their goodputs at 0.93 of each other at 0.25 and 0.79 at 0.125, so 0.125 is where (R) can
  be decided.
- SLOs: TTFT 0.25 s (DistServe's chatbot SLO); TPOT scaled to the modelled step
  (steady_state.scaled_tpot_slo: 0.8 of the way from an idle step to a saturated one), so that it
  binds; both written out.
- Goodput as DistServe defines it: the highest rate at which at least 90% of the window's requests
  meet both SLOs (a refused or unfinished request does not), found by bisection over the rate
  (steady_state.goodput_by_bisection between loads 0.1 and 0.95, to 5%, at most 8 runs), read
  as the straight-line crossing of 90% within the bisection's last bracket
  (steady_state.interpolated_goodput; the bracket's low end alone puts two strategies whose
  attainments differ by little a whole 5% apart), per GPU. SLO attainment at the four loads beside
  it.
- Seeds: 10 (each its own trace and arrivals); every strategy sees the same trace and arrivals of
  a seed, so comparisons are paired by seed: the mean of per-seed ratios with a Student-t 95%
  interval, n stated.
- Victim: newest_first (vLLM's rule) for all; admission: the predicted peak on every device
  (engine/per_device_admission.py) for all.

(V) Victims where they can act: `--strategies calibrated --victims newest_first pressure_aware
    expert_lru --topic-s S` (S in 0 and 1.5, one file each) compares them paired by seed; the
    verdict (PREREGISTERED's "victims") needs both files. sequence_lru is not run: every running
    sequence is used at every step, so its least recently used is a tie, broken as newest_first
    picks (engine/victims.py).

Spot checks beside the main comparison: `--topic-s` (the routing skew), `--workload decode_heavy`
(prompts of about 200 tokens, outputs log-normal with a mean of 3,000), and `--time-scale 3` or
`10` (every modelled time multiplied: does the ranking hold?), each into its own --json file.

Each (strategy, victim, memory, seed) is one task: its four loads and its bisection, in a process of its
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
from ..plots.reservation import paired_seeds
from ..sim.cluster import BLOCK_SIZE, MODEL, cluster_placement
from ..sim.runner import RunnerSetup, TraceRunner
from ..sim.steady_state import (
    TTFT_SLO,
    capacity,
    goodput_by_bisection,
    interpolated_goodput,
    latency_arrays,
    scaled_tpot_slo,
    steady_window,
    trace_lengths,
    window_attainment,
    working_set,
)
from ..sim.workloads import arrival_times
from ..stats import paired_ratio
from ..validation import check_int, check_real
from . import options
from .bench_cluster import ACTIVE_PARAMS, DECODE_HEAVY, TOPIC_S, cluster_workload

STRATEGIES = ("worst_case", "optimistic", "calibrated", "clairvoyant")
LOADS = (0.5, 0.7, 0.85, 0.95)  # utilization of the modelled capacity
MEMORY = (0.125, 0.5, 1.0)  # KV per GPU, multiples of the working set at MEMORY_LOAD
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
# every strategy's admission: the predicted peak checked on every device (engine/per_device_admission.py);
# summed over the devices it lets the device a skew fills first overflow, and the requests then
# admitted are preempted later (calibrated(0.99) at 0.5x the working set and load 0.6, seed 0:
# 1,164 preemptions and attainment 0.18 summed, 366 and 0.60 per device)
ADMISSION = "predicted_per_device"
TARGET = 0.9  # DistServe's attainment target
BISECTION_LOW = 0.1  # goodput's bisection starts between 0.1 and 0.95 of capacity
# (R)'s numbers (PREREGISTERED says them in words): worst case / clairvoyant at most GATE opens the
# gate; calibrated passes with its interval's low end above PASS_MARK, faults on under MAX_FAULT_STEPS
# of steps and under MAX_THROWN_AWAY of the modelled time thrown away
GATE = 0.8
PASS_MARK = 0.95
MAX_FAULT_STEPS = 0.01
MAX_THROWN_AWAY = 0.02
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
    "victims": "(V) under calibrated reservation, at topic_s >= 1.5 the best device-aware victim "
    "(pressure_aware or expert_lru) beats newest_first by at least 10% in goodput (paired 95% CI of "
    "the ratio above 1), and at topic_s = 0 every victim is within 3%; if not, the claims that the "
    "victim matters go",
}


@cache
def trace_of(seed: int, num_requests: int, workload: str, topic_s: float):
    """The routing trace of a seed (cached per process: every task of a seed reads it)."""
    return cluster_workload(num_requests, workload, seed, topic_s)


def base_setup(blocks_per_device: int) -> RunnerSetup:
    return RunnerSetup(
        blocks_per_device=blocks_per_device,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        admission=ADMISSION,
    )


def cost_model(time_scale: float = 1.0):
    """The cluster's cost model, every time multiplied by time_scale (the robustness check)."""
    cost = cluster_cost_model(get_config(MODEL), ACTIVE_PARAMS, NUM_DEVICES, BLOCK_SIZE)
    return cost if time_scale == 1 else cost.scaled(time_scale)


def reservation_of(strategy: str):
    """A fresh policy object for a run (calibrated learns from the requests it serves)."""
    if strategy == "calibrated":
        return CalibratedReservation(q=QUANTILE, max_chunk_tokens=MAX_CHUNK_TOKENS)
    return strategy


def calibrate(settings: dict) -> dict:
    """Seed 0's capacity (load 1.0), working set at MEMORY_LOAD and the TPOT SLO: the study's scales."""
    trace = trace_of(0, settings["requests"], settings["workload"], settings["topic_s"])
    placement = cluster_placement(NUM_DEVICES)
    cost = cost_model(settings["time_scale"])
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


def run_at(
    strategy: str, victim: str, blocks: int, seed: int, rate: float, settings: dict, scales: dict
) -> dict:
    """One run: the window's attainment and what the reservation cost."""
    trace = trace_of(seed, settings["requests"], settings["workload"], settings["topic_s"])
    setup = replace(base_setup(blocks), reservation=reservation_of(strategy))
    arrival = arrival_times(trace.num_sequences, rate, "poisson", seed=seed)
    started = time.perf_counter()
    cost = cost_model(settings["time_scale"])
    runner = TraceRunner(trace, cluster_placement(NUM_DEVICES), setup, victim, cost, arrivals=arrival)
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


def task(strategy: str, victim: str, memory: float, seed: int, settings: dict, scales: dict) -> dict:
    """One (strategy, victim, memory, seed): attainment at each load, then goodput by bisection (the
    loads' runs reused where the bisection asks for their rates)."""
    blocks = max(1, round(memory * scales["working_set_blocks"]))
    rate_of_load = scales["capacity_requests_per_s"]
    runs = {}

    def attainment_at(rate: float) -> float:
        if rate not in runs:
            runs[rate] = run_at(strategy, victim, blocks, seed, rate, settings, scales)
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
        "victim": victim,
        "memory": memory,
        "blocks_per_device": blocks,
        "seed": seed,
        "loads": loads,
        "goodput": goodput,
        "goodput_per_gpu": interpolated_goodput(goodput["evaluations"], TARGET) / NUM_DEVICES,
        "bracket_low_per_gpu": goodput["goodput"] / NUM_DEVICES,
        "fault_step_fraction": sum(r["faulted_steps"] for r in every) / max(1, steps),
        "thrown_away_fraction": sum(r["thrown_away_seconds"] for r in every)
        / max(1e-12, sum(r["modelled_seconds"] for r in every)),
        "bisection_runs": [runs[rate] for rate, _ in goodput["evaluations"]],
    }


def one_thread() -> None:
    """A worker computes on one core: --workers of them share the machine."""
    torch.set_num_threads(1)


def task_key(strategy: str, victim: str, memory: float, seed: int) -> str:
    return f"{strategy}|{victim}|{memory:g}|{seed}"


def with_interpolated_goodput(tasks: dict) -> dict:
    """Tasks run before the goodput was read as the crossing within the last bracket: the same
    bisection runs, read again (the bracket's low end kept as bracket_low_per_gpu)."""
    migrated = {}
    for key, t in tasks.items():
        if "bracket_low_per_gpu" not in t:
            t = {
                **t,
                "goodput_per_gpu": interpolated_goodput(t["goodput"]["evaluations"], TARGET) / NUM_DEVICES,
                "bracket_low_per_gpu": t["goodput"]["goodput"] / NUM_DEVICES,
            }
        migrated[key] = t
    return migrated


def keyed_by_victim(tasks: dict) -> dict:
    """Tasks keyed as task_key keys them (a file written before tasks named their victim ran
    newest_first)."""
    return {
        task_key(t["strategy"], t.get("victim", VICTIM), t["memory"], t["seed"]): {"victim": VICTIM, **t}
        for t in tasks.values()
    }


def summarize(result: dict) -> dict:
    """Per memory: each strategy's goodput per GPU (mean over seeds), the paired ratios to
    clairvoyant and calibrated's to worst case, the fault and thrown-away fractions, and the verdict
    of (R) as PREREGISTERED says."""
    tasks = [t for t in result["tasks"].values() if t.get("victim", VICTIM) == VICTIM]
    summary = {}
    for memory in MEMORY:
        seeds = paired_seeds(tasks, memory)
        tasks_here = [t for t in tasks if t["memory"] == memory and t["seed"] in seeds]
        per = {
            strategy: {t["seed"]: t["goodput_per_gpu"] for t in tasks_here if t["strategy"] == strategy}
            for strategy in STRATEGIES
        }
        bound = per["clairvoyant"]
        rows = {}
        for strategy in STRATEGIES:
            chosen = [t for t in tasks_here if t["strategy"] == strategy]
            rows[strategy] = {
                "n": len(per[strategy]),
                "goodput_per_gpu_mean": statistics.fmean(per[strategy].values())
                if per[strategy]
                else float("nan"),
                "over_clairvoyant": paired_ratio(per[strategy], bound),
                "fault_step_fraction_max": max(
                    (t["fault_step_fraction"] for t in chosen), default=float("nan")
                ),
                "thrown_away_fraction_max": max(
                    (t["thrown_away_fraction"] for t in chosen), default=float("nan")
                ),
            }
        calibrated_over_worst = paired_ratio(per["calibrated"], per["worst_case"])
        gate = rows["worst_case"]["over_clairvoyant"]["mean"] <= GATE
        calibrated = rows["calibrated"]
        passes = (
            calibrated["over_clairvoyant"]["ci95"][0] > PASS_MARK
            and calibrated["fault_step_fraction_max"] < MAX_FAULT_STEPS
            and calibrated["thrown_away_fraction_max"] < MAX_THROWN_AWAY
        )
        summary[f"{memory:g}"] = {
            "strategies": rows,
            "calibrated_over_worst_case": calibrated_over_worst,
            "gate_binds": gate,
            "R_passes": passes if gate else None,
            "seeds": sorted(seeds),
            "complete": len(seeds) == result["seeds"],
        }
    return summary


def summarize_victims(result: dict) -> dict:
    """Per memory and strategy, each victim policy's goodput against newest_first's, paired by seed:
    the ratio's mean and 95% interval, n, and the verdict's pieces at this file's skew (V): whether
    the best device-aware policy (pressure_aware, expert_lru) gains at least 10% with an interval
    above 1, and whether every policy is within 3% of newest_first."""
    victims = result.get("design", {}).get("victims", [VICTIM])
    summary = {}
    for memory in MEMORY:
        for strategy in result.get("design", {}).get("strategies", STRATEGIES):
            per = {
                victim: {
                    t["seed"]: t["goodput_per_gpu"]
                    for t in result["tasks"].values()
                    if (t["strategy"], t.get("victim", VICTIM), t["memory"]) == (strategy, victim, memory)
                }
                for victim in victims
            }
            if VICTIM not in per or not per[VICTIM]:
                continue
            ratios = {
                victim: paired_ratio(per[victim], per[VICTIM]) for victim in victims if victim != VICTIM
            }
            aware = [ratios[v] for v in ("pressure_aware", "expert_lru") if v in ratios]
            best = max(aware, key=lambda r: r["mean"], default=None)
            summary[f"{memory:g}|{strategy}"] = {
                "over_newest_first": ratios,
                "best_device_aware_gains_10_percent": None
                if best is None
                else bool(best["mean"] >= 1.10 and best["ci95"][0] > 1.0),
                "all_within_3_percent": all(abs(r["mean"] - 1) <= 0.03 for r in ratios.values()),
            }
    return summary


ONLINE_VICTIMS = ("newest_first", "sequence_lru", "pressure_aware", "expert_lru")


def build_parser(parser=None):
    parser = parser or argparse.ArgumentParser(prog="python -m moekv_ref bench reservation")
    parser.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds 0..N-1 (default {SEEDS})")
    parser.add_argument("--requests", type=int, default=REQUESTS, help=f"requests a run (default {REQUESTS})")
    parser.add_argument("--workers", type=int, default=2, help="processes at once (default 2)")
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES, help="(default: all four)"
    )
    parser.add_argument(
        "--victims",
        nargs="+",
        default=[VICTIM],
        choices=ONLINE_VICTIMS,
        help=f"victim policies (default {VICTIM}; sequence_lru picks as newest_first does)",
    )
    parser.add_argument(
        "--memory",
        nargs="+",
        type=float,
        default=list(MEMORY),
        help="KV per GPU, multiples of the working set (default: all; a spot check takes the tightest)",
    )
    parser.add_argument("--topic-s", type=float, default=TOPIC_S, help=f"routing skew (default {TOPIC_S})")
    parser.add_argument(
        "--workload", default=WORKLOAD, choices=(WORKLOAD, DECODE_HEAVY), help="request lengths"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="every modelled time multiplied by this (robustness: 3, 10)",
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
    for memory in args.memory:
        if memory not in MEMORY:
            raise ValueError(
                f"--memory={memory:g} is not one of {MEMORY} (KV per GPU, multiples of the working set)"
            )
    check_real("--topic-s", args.topic_s, 0, 4, meaning="the topics' Zipf exponent")
    check_real(
        "--time-scale", args.time_scale, 0.01, 1000, meaning="what every modelled time is multiplied by"
    )
    options.output_file("--json", args.json, parents_made=True)


def settings_of(args) -> dict:
    return {
        "requests": args.requests,
        "seeds": args.seeds,
        "workload": args.workload,
        "topic_s": args.topic_s,
        "time_scale": args.time_scale,
    }


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
    settings = settings_of(args)
    if result:
        held = {name: result.get(name, result.get("design", {}).get(name)) for name in settings}
        held["workload"] = held["workload"] or WORKLOAD  # files from before these options held
        held["topic_s"] = TOPIC_S if held["topic_s"] is None else held["topic_s"]
        held["time_scale"] = 1.0 if held["time_scale"] is None else held["time_scale"]
        if held != settings:
            raise ValueError(f"{path} holds a study of {held}, not {settings}: give another --json")
        result["tasks"] = with_interpolated_goodput(keyed_by_victim(result["tasks"]))
        result["design"]["memory_multiples"] = MEMORY
    else:
        started = time.perf_counter()
        result = {
            **settings,
            "preregistered": PREREGISTERED,
            "design": {
                "model": MODEL,
                "devices": NUM_DEVICES,
                "loads": LOADS,
                "memory_multiples": MEMORY,
                "memory_load": MEMORY_LOAD,
                "quantile": QUANTILE,
                "max_chunk_tokens": MAX_CHUNK_TOKENS,
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "admission": ADMISSION,
                "warmup_cooldown": [0.1, 0.1],
            },
            "scales": calibrate(settings),
            "tasks": {},
            "commits": [],
        }
        result["scales"]["wall_seconds"] = time.perf_counter() - started
    result["design"]["strategies"] = sorted(
        set(result["design"].get("strategies", [])) | set(args.strategies)
    )
    result["design"]["victims"] = sorted(set(result["design"].get("victims", [VICTIM])) | set(args.victims))
    if commit not in result["commits"]:
        result["commits"].append(commit)
    todo = [
        (strategy, victim, memory, seed)
        for memory in MEMORY  # the tightest memory first: where the gate binds, (R) is decided
        if memory in args.memory
        for seed in range(args.seeds)
        for victim in args.victims
        for strategy in args.strategies
        if task_key(strategy, victim, memory, seed) not in result["tasks"]
    ]
    print(
        f"capacity {result['scales']['capacity_requests_per_s']:.1f} requests/s, working set "
        f"{result['scales']['working_set_blocks']:.0f} blocks a GPU at load {MEMORY_LOAD}, TPOT SLO "
        f"{result['scales']['tpot_slo_s'] * 1e3:.1f} ms; {len(todo)} tasks to run",
        flush=True,
    )
    jsonout.write(path, result, indent=1)
    # spawned, not forked: a process forked from one whose torch has started its threads can hang
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=spawn, initializer=one_thread) as pool:
        futures = {pool.submit(task, *key, settings, result["scales"]): key for key in todo}
        for future in tqdm(as_completed(futures), total=len(futures), desc="tasks"):
            done = future.result()
            done["commit"] = commit
            result["tasks"][task_key(*futures[future])] = done
            result["summary"] = summarize(result)
            result["victims_summary"] = summarize_victims(result)
            jsonout.write(path, result, indent=1)
    print_summary(result)
    return 0


def print_summary(result: dict) -> None:
    for key, row in summarize_victims(result).items():
        memory, strategy = key.split("|")
        for victim, ratio in row["over_newest_first"].items():
            print(
                f"memory {memory} x working set, {strategy}: {victim} x newest_first {ratio['mean']:.3f} "
                f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] (n={ratio['n']})"
            )
    if "clairvoyant" not in result["design"]["strategies"]:
        return
    for memory, row in summarize(result).items():
        print(f"memory {memory} x working set: gate binds {row['gate_binds']}, (R) passes {row['R_passes']}")
        for strategy, numbers in row["strategies"].items():
            ratio = numbers["over_clairvoyant"]
            print(
                f"  {strategy:12s} n={numbers['n']:2d} goodput/GPU {numbers['goodput_per_gpu_mean']:7.2f} "
                f"x clairvoyant {ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] "
                f"faults {numbers['fault_step_fraction_max']:.4f} thrown {numbers['thrown_away_fraction_max']:.4f}"
            )


def markdown_tables(result: dict) -> str:
    """The study's tables as docs/results.md quotes them (a test holds the text to the JSON): per
    memory setting, each strategy's goodput per GPU and its ratio to clairvoyant's, paired by seed,
    with the faults and the time thrown away; calibrated's ratio to worst case and (R)'s verdict;
    the victims' ratios to newest_first with (V)'s sentence; then SLO attainment at each load."""
    lines = [
        "| KV per GPU | strategy | n | goodput per GPU (req/s) | x clairvoyant, mean [95% CI] "
        "| steps with a fault (max) | time thrown away (max) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    blocks = result["scales"]["working_set_blocks"]
    summary = summarize(result)
    for memory in MEMORY:
        row = summary[f"{memory:g}"]
        for strategy, numbers in row["strategies"].items():
            if not numbers["n"]:
                continue
            ratio = numbers["over_clairvoyant"]
            lines.append(
                f"| {memory:g} x ({memory * blocks / 1e3:.0f}k blocks) | {strategy} | {numbers['n']} | "
                f"{numbers['goodput_per_gpu_mean']:.2f} | {ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, "
                f"{ratio['ci95'][1]:.3f}] | {numbers['fault_step_fraction_max']:.2%} | "
                f"{numbers['thrown_away_fraction_max']:.2%} |"
            )
    lines += ["", "| KV per GPU | n | calibrated / worst case, mean [95% CI] | gate open | stated test |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for memory in MEMORY:
        row = summary[f"{memory:g}"]
        ratio = row["calibrated_over_worst_case"]
        if ratio["n"] < 2:
            continue
        test = {True: "passes", False: "fails", None: "no verdict"}[row["R_passes"]]
        lines.append(
            f"| {memory:g} x | {ratio['n']} | {ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, "
            f"{ratio['ci95'][1]:.3f}] | {'yes' if row['gate_binds'] else 'no'} | {test} |"
        )
    victims = [
        (key, victim, ratio)
        for key, row in summarize_victims(result).items()
        for victim, ratio in row["over_newest_first"].items()
        if ratio["n"] >= 2
    ]
    if victims:
        lines += ["", "| KV per GPU, reservation | victim | n | goodput / newest_first's, mean [95% CI] |"]
        lines.append("| --- | --- | --- | --- |")
        for key, victim, ratio in victims:
            memory, strategy = key.split("|")
            lines.append(
                f"| {memory} x, {strategy} | {victim} | {ratio['n']} | {ratio['mean']:.3f} "
                f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] |"
            )
        lines.append("")
        for memory in dict.fromkeys(key.split("|")[0] for key, _, _ in victims):
            lines.append(f"(V) with {memory}x the working set: {victims_verdict(result, float(memory))}.")
    lines += [
        "",
        "| KV per GPU | strategy | " + " | ".join(f"load {load:g}" for load in LOADS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in LOADS) + " |",
    ]
    for memory in MEMORY:
        mains = [t for t in result["tasks"].values() if t.get("victim", VICTIM) == VICTIM]
        seeds = paired_seeds(mains, memory)
        for strategy in STRATEGIES:
            chosen = [
                t for t in mains if (t["strategy"], t["memory"]) == (strategy, memory) and t["seed"] in seeds
            ]
            if not chosen:
                continue
            cells = [statistics.fmean(t["loads"][str(load)]["attainment"] for t in chosen) for load in LOADS]
            lines.append(f"| {memory:g} x | {strategy} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def robustness_table(results: dict) -> str:
    """docs/results.md's robustness check, one row per (step-time scale, memory) where worst case
    and calibrated both ran on two seeds or more: results maps each scale (1 for the main study)
    to its study. Each strategy's goodput per GPU, calibrated / worst case paired by seed, and
    whether calibrated still ranks above worst case (the ratio's interval above 1) or below it."""
    lines = [
        "| step times | KV per GPU | n | goodput per GPU (req/s): worst case | calibrated "
        "| calibrated / worst case, mean [95% CI] | ranking |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scale, result in results.items():
        summary = summarize(result)
        for memory in MEMORY:
            row = summary[f"{memory:g}"]
            ratio = row["calibrated_over_worst_case"]
            if ratio["n"] < 2:
                continue
            low, high = ratio["ci95"]
            ranking = "calibrated first" if low > 1 else "worst case first" if high < 1 else "not told apart"
            goodput = {s: row["strategies"][s]["goodput_per_gpu_mean"] for s in ("worst_case", "calibrated")}
            lines.append(
                f"| x{scale:g} | {memory:g} x | {ratio['n']} | {goodput['worst_case']:.2f} | "
                f"{goodput['calibrated']:.2f} | {ratio['mean']:.3f} [{low:.3f}, {high:.3f}] | {ranking} |"
            )
    return "\n".join(lines)


def headline(result: dict, memory: float) -> str:
    """One sentence of the study's numbers at one memory setting, as the README quotes it (a test
    holds the README to it): each strategy's mean goodput per GPU, and calibrated's paired ratio to
    clairvoyant with its interval, with n."""
    row = summarize(result)[f"{memory:g}"]
    numbers = row["strategies"]
    run = [s for s in STRATEGIES if numbers[s]["n"] >= 2]  # a strategy not run there is not named
    n = min(numbers[s]["n"] for s in run)
    goodputs = ", ".join(f"{s.replace('_', ' ')} {numbers[s]['goodput_per_gpu_mean']:.2f}" for s in run)
    ratio = numbers["calibrated"]["over_clairvoyant"]
    blocks = memory * result["scales"]["working_set_blocks"]
    return (
        f"with {memory:g}x the working set ({blocks / 1e3:.0f}k blocks a GPU) and n = {n} seeds, goodput "
        f"per GPU is {goodputs} requests/s; calibrated reaches {ratio['mean']:.3f} "
        f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] of clairvoyant's"
    )


def verdict(result: dict, memory: float) -> str:
    """What (R) says at one memory setting, as the README quotes it: worst case's paired ratio to
    clairvoyant against the gate, and, where the gate holds, calibrated's interval against the pass
    mark, with the faults and the time thrown away."""
    row = summarize(result)[f"{memory:g}"]
    numbers = row["strategies"]
    worst = numbers["worst_case"]["over_clairvoyant"]
    calibrated = numbers["calibrated"]
    text = (
        f"worst case reaches {worst['mean']:.3f} [{worst['ci95'][0]:.3f}, {worst['ci95'][1]:.3f}] of the "
        f"bound, so the stated gate (at most {GATE:.2f}) {'holds' if row['gate_binds'] else 'does not hold'}"
    )
    if row["R_passes"] is None:
        return text
    low = calibrated["over_clairvoyant"]["ci95"][0]
    return (
        f"{text}; calibrated's interval {'clears' if low > PASS_MARK else 'does not clear'} {PASS_MARK:.2f}, with "
        f"{calibrated['fault_step_fraction_max']:.2%} of steps short and "
        f"{calibrated['thrown_away_fraction_max']:.2%} of the time thrown away at most: the stated test "
        f"{'passes' if row['R_passes'] else 'fails'}"
    )


def victims_verdict(result: dict, memory: float, strategy: str = "calibrated") -> str:
    """What (V) says in this file (one skew) at one memory setting, as the README quotes it: the best
    device-aware victim's goodput over newest_first's, paired by seed, against the stated gain of
    10% (with the interval above 1). At a skew of 1.5 or more a shortfall decides (V): it fails."""
    row = summarize_victims(result).get(f"{memory:g}|{strategy}")
    aware = {} if row is None else row["over_newest_first"]
    aware = {v: r for v, r in aware.items() if v in ("pressure_aware", "expert_lru") and r["n"] >= 2}
    if not aware:
        return f"no device-aware victim has run at {memory:g}x on two seeds or more: (V) has no verdict"
    best, ratio = max(aware.items(), key=lambda item: item[1]["mean"])
    gains = row["best_device_aware_gains_10_percent"]
    topic_s = result.get("topic_s", TOPIC_S)  # a file from before the option held ran the default
    text = (
        f"at topic_s {topic_s:g}, the best device-aware victim, {best}, reaches "
        f"{ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] of newest_first's goodput "
        f"(n = {ratio['n']})"
    )
    if gains:
        return f"{text}: the stated gain of 10% holds"
    if topic_s >= 1.5:
        return f"{text}, short of the stated gain of 10%: (V) fails"
    return f"{text}, short of the stated gain of 10%"


def status_line(result: dict) -> str:
    """Where the study stands, as docs/results.md says it: the paired seeds so far of each memory
    setting, of how many, and the commits the runs came from."""
    summary = summarize(result)
    done = ", ".join(f"{len(summary[f'{m:g}']['seeds'])} at {m:g}x" for m in MEMORY)
    finished = all(summary[f"{m:g}"]["complete"] for m in MEMORY)
    where = "complete" if finished else "unfinished"
    return (
        f"The study is {where}: paired seeds {done}, of {result['seeds']} stated; the runs came from "
        f"commit {', '.join(result['commits'])}."
    )
