"""`python -m moekv_ref bench eviction [--json PATH]`: eviction when one expert's device is short.

Four parts, printed as tables and saved together as JSON:

 1. recompute versus swap, measured on this machine with the embedded model (a prefill of c tokens
    through the paged cache against SwapSpace.swap_out + swap_in of the same sequence), for several
    block sizes; fitted into a CostModel; the crossover context (from where swap is cheaper), here
    and projected for a GPU from datasheet numbers (moekv_ref/costs.py) at JetMoE-8B's shape with
    per-expert K/V (the preset jetmoe-8b-expert-kv);
 2. every victim policy on one skewed workload, the engine's Scheduler replaying a routing trace
    (sim/runner.py): per-device pools (D = 4, E = 16), a topic trace whose popular topic's experts
    share device 0 under the co-activation placement, the offline policies (oracle, belady) beside
    the online ones, and the memory-time bound; then the online policies on the engine over
    per-device pools (LLMEngine with blocks_per_device) with the embedded model;
 3. density: for each expert buffer, the fraction of the running batch's sequences it holds, against
    E, k and skew;
 4. prefix caching (cache/prefix_cache.py) on a few-shot workload, both routings of the embedded model,
    without and with the cache: hit rates, prefill tokens and steps saved, tokens/s, equal outputs.
    `--only-prefix-cache --json PATH` runs this part alone and updates it in an existing file.

`--optimum --json PATH` runs something else alone: on a few small instances (8-10 sequences, two
devices, a tight pool), the exact best schedule of victim choices (sim/optimum.py) beside every
policy and the memory-time bound (figures/eviction_optimum.json, which notebook 05 reads).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ..analysis import record_model_trace
from ..cache.paged import PagedKVCache
from ..checkpoint import load_default_model
from ..config import get_config
from ..costs import CostModel, crossover_context, fit_cost_model, projected_gpu_cost_model
from ..engine.demand import worst_case_lifetime_blocks_per_device
from ..engine.engine import LLMEngine
from ..engine.model_runner import ModelRunner
from ..engine.scheduler_config import SchedulerConfig
from ..engine.swap import SwapSpace
from ..engine.workload import few_shot_workload, make_workload, run_workload
from ..jsonout import dump
from ..paths import output_path
from ..plots.tables import text_table
from ..sim.density import density_sweep, mean_blocks_at_context
from ..sim.optimum import search_optimum
from ..sim.runner import RunnerSetup, memory_time_bound, simulate
from ..sim.traces import synthetic_trace
from ..sim.workloads import skewed_workload, workload_cost_model
from ..validation import MAX_BLOCKS
from . import options

# JetMoE-8B: 2.2 B active parameters per token (Shen et al., arXiv 2404.07413, Table 1).
JETMOE_ACTIVE_PARAMS = 2.2e9


# ----- 1. recompute versus swap ------------------------------------------------------------------------
def measure_recompute_and_swap(model, contexts, block_sizes, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Median seconds of recomputing (prefilling) c tokens and of swapping the resulting sequence out
    and back in, for each context c and block size P, with the engine's own PagedKVCache and
    SwapSpace. Returns one dict per (P, c): blocks, bytes, recompute_seconds, swap_seconds."""
    torch.manual_seed(seed)
    config = model.config
    rows = []
    longest = max(contexts)
    tokens = torch.randint(0, config.vocab_size, (longest,))
    for P in block_sizes:
        for c in contexts:
            num_blocks = config.max_kv_entries_per_token * (-(-c // P) + 1) * 2
            recompute, swap, blocks = [], [], 0
            for _ in range(repeats):
                cache = PagedKVCache.for_model(
                    model, block_size=P, num_blocks=num_blocks, attention="batched"
                )
                started = time.perf_counter()
                with torch.no_grad():
                    model.forward_cached(
                        tokens[:c], torch.zeros(c, dtype=torch.int64), torch.arange(c), cache
                    )
                recompute.append(time.perf_counter() - started)
                space, runner = SwapSpace(cache.manager, num_blocks), ModelRunner(model, cache, num_blocks)
                started = time.perf_counter()
                copy_out = space.swap_out(0)  # the bookkeeping, then the K/V copies
                runner.copy_blocks([copy_out])
                runner.copy_blocks([space.swap_in(0)])
                swap.append(time.perf_counter() - started)
                blocks = int(copy_out.source.numel())
            block_bytes = (
                2 * P * config.num_key_value_heads * config.head_dim * cache.key_cache.element_size()
            )
            rows.append(
                {
                    "block_size": P,
                    "context": c,
                    "blocks": blocks,
                    "bytes": blocks * block_bytes,
                    "block_bytes": block_bytes,
                    "recompute_seconds": sorted(recompute)[repeats // 2],
                    "swap_seconds": sorted(swap)[repeats // 2],
                }
            )
    return rows


def measured_crossovers(rows: list[dict]) -> dict:
    """Per block size: the fitted CostModel and the crossover context, straight from the measured
    pairs (the shortest context from which every measured swap beat its recompute)."""
    out = {}
    for P in sorted({r["block_size"] for r in rows}):
        mine = [r for r in rows if r["block_size"] == P]
        cost = fit_cost_model(
            [r["context"] for r in mine],
            [r["recompute_seconds"] for r in mine],
            [r["blocks"] for r in mine],
            [r["swap_seconds"] for r in mine],
            mine[0]["block_bytes"],
        )
        wins = [r["swap_seconds"] < r["recompute_seconds"] for r in mine]
        crossover = next((mine[i]["context"] for i in range(len(wins)) if all(wins[i:])), None)
        out[P] = {"cost_model": cost.to_dict(), "crossover_context": crossover}
    return out


def projected_crossovers(block_sizes, contexts, links=None, num_sequences: int = 16, seed: int = 0) -> dict:
    """Crossover contexts projected for an H100 at JetMoE-8B's shape with per-expert K/V (preset
    jetmoe-8b-expert-kv: 24 layers, 8 attention experts, top-2, each keeping 16 KV heads of 128 in
    bf16; 2.2 B active parameters), over each host link. Blocks at each
    context are counted on a synthetic top-2 trace (Zipf 1.0 expert popularity). links: label -> a
    name in costs.HOST_LINKS."""
    config = get_config("jetmoe-8b-expert-kv")
    links = links or {"PCIe Gen5 x16 (64 GB/s)": "pcie_gen5_x16", "NVLink-C2C (450 GB/s)": "nvlink_c2c"}
    L, E, K = config.num_hidden_layers, config.num_attention_experts, config.num_attention_experts_per_tok
    trace = synthetic_trace(
        num_sequences,
        L,
        E,
        K,
        mean_prompt=max(contexts),
        mean_output=1,
        sigma=0.0,
        zipf_s=1.0,
        kv_bytes_per_slot=config.kv_bytes_per_entry(),
        seed=seed,
    )
    out = {}
    for link_name, host_link in links.items():
        for P in block_sizes:
            cost = projected_gpu_cost_model(
                JETMOE_ACTIVE_PARAMS,
                config.kv_bytes_per_entry(),
                L,
                K,
                E,
                config.head_dim,
                config.num_attention_heads,
                P,
                host_link=host_link,
                name=f"H100 + {link_name}",
            )
            blocks = mean_blocks_at_context(trace, contexts, P)
            out[f"{link_name}, P={P}"] = {
                "link": link_name,
                "block_size": P,
                "crossover_context": crossover_context(cost, contexts, blocks),
                "recompute_seconds": [float(cost.recompute_seconds(c)) for c in contexts],
                "swap_seconds": [float(cost.swap_seconds(b)) for b in blocks.tolist()],
                "contexts": list(contexts),
            }
    return out


# ----- 2. the policies on one skewed workload --------------------------------------------------------------
SIM_POLICIES = (
    "sequence_lru",
    "expert_lru",
    "pressure_aware",
    "oracle",
    "belady",
)  # newest_first is sequence_lru


def compare_policies(trace, placement, setup: RunnerSetup, cost: CostModel, policies=SIM_POLICIES) -> dict:
    """Every policy on the same workload (the scheduler over the trace, sim/runner.py), and the
    memory-time bound."""
    results = {}
    for name in policies:
        stats = simulate(trace, placement, setup, name, cost)
        results[name] = stats
    return {"stats": results, "bound": memory_time_bound(trace, placement, setup)}


def format_comparison(comparison: dict) -> str:
    header = (
        f"{'policy':>15} {'steps':>6} {'tok/step':>9} {'tok/s':>9} {'recomputed':>10} {'swapped MB':>10} "
        f"{'evictions':>9} {'victims':>7} {'freed/evict':>11} {'refused':>7}"
    )
    lines = [header]
    for name, s in comparison["stats"].items():
        lines.append(
            f"{name:>15} {s.num_steps:>6} {s.tokens_per_step:>9.2f} {s.tokens_per_second:>9.0f} "
            f"{s.recomputed_tokens:>10} {s.swapped_bytes / 1e6:>10.1f} {s.num_evictions:>9} "
            f"{s.num_victim_sequences:>7} {s.freed_per_eviction:>11.1f} {s.num_refused:>7}"
        )
    bound = comparison["bound"]
    lines.append(
        f"{'bound':>15} {bound['steps']:>6.0f} {bound['tokens_per_step']:>9.2f}   (memory-time bound: no "
        "policy does better per step)"
    )
    for offline_name in ("belady", "oracle"):  # the heuristics that know the future, as yardsticks
        offline = comparison["stats"].get(offline_name)
        if offline is None:
            continue
        for name, s in comparison["stats"].items():
            if name != offline_name:
                lines.append(
                    f"  {name}: {s.tokens_per_second / offline.tokens_per_second:.3f} of {offline_name}'s "
                    f"tokens/s, {s.tokens_per_step / offline.tokens_per_step:.3f} of its tokens/step, "
                    f"{s.tokens_per_step / bound['tokens_per_step']:.3f} of the bound's tokens/step"
                )
    return "\n".join(lines)


# ----- 2b. the policies on the engine, with the embedded model -------------------------------------------------
ENGINE_POLICIES = ("newest_first", "sequence_lru", "expert_lru", "pressure_aware")


def engine_placement(model, workload, num_devices: int = 4) -> torch.Tensor:
    """(L, E): a skewed placement of the embedded model's experts, so that one device fills first:
    in each layer the E / D experts the workload's prompts route to most share device 0, the rest
    go round-robin over the other devices, most popular first."""
    trace = record_model_trace(model, [r.prompt for r in workload], [1] * len(workload))
    L, E = trace.num_layers, trace.num_experts
    chosen = trace.experts.long()  # (tokens, L, K)
    placement = torch.zeros(L, E, dtype=torch.int64)
    per_device = E // num_devices
    for layer in range(L):
        picks = chosen[:, layer]
        popularity = torch.bincount(picks[picks >= 0], minlength=E)  # (E,)
        order = torch.argsort(popularity, descending=True, stable=True)
        placement[layer, order[:per_device]] = 0
        rest = order[per_device:]
        placement[layer, rest] = 1 + torch.arange(rest.numel()) % (num_devices - 1)
    return placement


def compare_engine_policies(
    model,
    workload,
    blocks_per_device,
    placement,
    block_size: int = 4,
    preemption_mode: str = "recompute",
    policies=ENGINE_POLICIES,
) -> dict:
    """Every victim policy on LLMEngine over per-device pools and the same requests (all arriving at step 0),
    optimistic admission (so that memory runs short and victims are chosen). Returns per policy the
    engine's eviction statistics, throughput (generated tokens per step and per wall second) and whether
    every policy produced the same tokens (each equals generating alone: tests)."""
    results, tokens = {}, {}
    for name in policies:
        config = SchedulerConfig(
            victim=name,
            admission="optimistic",
            preemption_mode=preemption_mode,
            max_num_seqs=16,
            max_num_batched_tokens=512,
        )
        engine = LLMEngine(
            model,
            block_size=block_size,
            scheduler_config=config,
            blocks_per_device=blocks_per_device,
            device_of_expert=placement,
        )
        started = time.perf_counter()
        outputs = engine.generate([r.prompt for r in workload], [r.sampling_params for r in workload])
        seconds = time.perf_counter() - started
        engine.memory.assert_no_leak()
        stats = engine.eviction_stats()
        stats["tokens_per_step"] = stats["num_generated_tokens"] / stats["num_steps"]
        stats["tokens_per_second"] = stats["num_generated_tokens"] / seconds
        results[name] = stats
        tokens[name] = [o.token_ids for o in outputs]
    first = next(iter(tokens.values()))
    return {"policies": results, "same_tokens": all(t == first for t in tokens.values())}


def format_engine_comparison(comparison: dict) -> str:
    lines = [
        f"{'policy':>15} {'steps':>6} {'tok/step':>9} {'tok/s':>7} {'preempt':>7} {'recomputed':>10} "
        f"{'swapped':>7} {'evictions':>9} {'rows':>5} {'freed/evict':>11} {'peak per device':>18}"
    ]
    for name, s in comparison["policies"].items():
        lines.append(
            f"{name:>15} {s['num_steps']:>6} {s['tokens_per_step']:>9.2f} {s['tokens_per_second']:>7.0f} "
            f"{s['num_preemptions']:>7} {s['num_recomputed_tokens']:>10} {s['num_swapped_out_blocks']:>7} "
            f"{s['num_evictions']:>9} {s['num_row_evictions']:>5} "
            f"{s['freed_on_short_device_per_eviction']:>11.1f} {str(s['peak_used_blocks_per_device']):>18}"
        )
    lines.append(f"  every policy gave the same tokens: {comparison['same_tokens']}")
    return "\n".join(lines)


# ----- 4. prefix caching on a few-shot workload ---------------------------------------------------------------
def compare_prefix_caching(
    model,
    workload,
    num_blocks: int = 4000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    repeats: int = 3,
    return_engine: bool = False,
) -> dict:
    """The same requests through LLMEngine without and with prefix caching (a pool large enough that
    nothing is preempted, so every difference is the cache's). Per setting: steps, tokens computed,
    generated tokens per wall second (median of `repeats` runs), and the blocks each request held
    right after its prefill (the prompt's blocks: the block hit rate's denominator); with the cache,
    its counters. Returns both and whether every request's tokens were equal; return_engine=True adds
    "engine": the first run with the cache (its finished requests kept, for plot_prefix_hit_map)."""
    runs, tokens = {}, {}
    for enabled in (False, True):
        seconds = []
        for repeat in range(repeats):
            engine = LLMEngine(
                model,
                num_blocks,
                block_size,
                SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
                record_history=True,
                enable_prefix_caching=enabled,
            )
            prompt_blocks = {}

            def after_step(engine, prompt_blocks=prompt_blocks):
                for request in engine.scheduler.running:
                    if len(request.output_token_ids) == 1 and request.request_id not in prompt_blocks:
                        prompt_blocks[request.request_id] = engine.memory.num_blocks_held(request.request_id)

            started = time.perf_counter()
            result = run_workload(engine, workload, on_step=after_step)
            seconds.append(time.perf_counter() - started)
            engine.memory.assert_no_leak()
            if repeat == 0:
                stats = engine.stats()
                row = {
                    "num_steps": stats.num_steps,
                    "num_preemptions": stats.num_preemptions,
                    "num_computed_tokens": sum(r.num_scheduled_tokens for r in engine.timeline),
                    "num_generated_tokens": stats.num_generated_tokens,
                    "num_prompt_tokens": sum(len(r.prompt) for r in workload),
                    "num_prompt_blocks": sum(prompt_blocks.values()),
                    "prefix_cache": engine.prefix_cache_stats(),
                }
                tokens[enabled] = [result.outputs[i].token_ids for i in range(len(workload))]
                if enabled:
                    first_engine = engine
        row["seconds"] = sorted(seconds)[repeats // 2]
        row["tokens_per_second"] = row["num_generated_tokens"] / row["seconds"]
        runs["on" if enabled else "off"] = row
    off, on = runs["off"], runs["on"]
    cache = on["prefix_cache"]
    summary = {
        "token_hit_rate": cache["num_hit_tokens"] / cache["num_lookup_tokens"],
        "block_hit_rate": (cache["num_shared_blocks"] + cache["num_cow_blocks"]) / off["num_prompt_blocks"],
        "prefill_tokens_saved": off["num_computed_tokens"] - on["num_computed_tokens"],
        "steps_saved": off["num_steps"] - on["num_steps"],
        "tokens_per_second_ratio": on["tokens_per_second"] / off["tokens_per_second"],
        "outputs_equal": tokens[False] == tokens[True],
    }
    return {"off": off, "on": on, **summary, **({"engine": first_engine} if return_engine else {})}


def format_prefix_caching(results: dict) -> str:
    """compare_prefix_caching's results per routing, as a table and one summary line per routing."""
    rows = []
    for routing, r in results.items():
        for name in ("off", "on"):
            x = r[name]
            cache = x["prefix_cache"] or {}
            rows.append(
                [
                    routing,
                    name,
                    x["num_steps"],
                    x["num_computed_tokens"],
                    cache.get("num_hit_tokens", 0),
                    cache.get("num_shared_blocks", 0),
                    cache.get("num_cow_blocks", 0),
                    x["num_prompt_blocks"],
                    x["tokens_per_second"],
                ]
            )
    table = text_table(
        ["routing", "cache", "steps", "computed", "hit tokens", "shared", "copied", "prompt blocks", "tok/s"],
        rows,
        [None] * 8 + ["{:.0f}"],
    )
    lines = [
        f"  {routing}: hit rate {r['token_hit_rate']:.3f} of tokens, {r['block_hit_rate']:.3f} of the prompts' "
        f"blocks; prefill tokens saved {r['prefill_tokens_saved']}, steps saved {r['steps_saved']}, "
        f"tokens/s x{r['tokens_per_second_ratio']:.2f}; outputs equal: {r['outputs_equal']}"
        for routing, r in results.items()
    ]
    return "\n".join([table] + lines)


def run_prefix_caching(quick: bool = False) -> dict:
    """Both routings of the embedded model on one few-shot workload: 16 requests (8 with --quick) of
    256 tokens, 224 of them shared, 16 new tokens each, greedy."""
    workload = few_shot_workload(8 if quick else 16, prompt_len=256, shared_share=0.875, output_len=16)
    results = {
        routing: compare_prefix_caching(
            load_default_model(routing=routing), workload, repeats=1 if quick else 3
        )
        for routing in ("topk", "threshold")
    }
    print(
        f"\nprefix caching, few-shot workload: {len(workload)} requests of 256 tokens (224 shared), 16 new tokens "
        "each, greedy; LLMEngine, 4000 blocks of 16, 16 sequences and 256 tokens per step"
    )
    print(format_prefix_caching(results))
    return {
        "num_requests": len(workload),
        "prompt_len": 256,
        "shared_len": 224,
        "output_len": 16,
        "block_size": 16,
        "num_blocks": 4000,
        "routings": results,
    }


# ----- 5. the exact optimum on small instances ----------------------------------------------------------------
# (sequences, mean output tokens, seed): instances on which evictions happen and policies differ
OPTIMUM_INSTANCES = ((8, 32, 0), (8, 32, 2), (10, 24, 0), (8, 32, 1))


def small_instance(
    num_sequences: int = 6, mean_output: float = 16, seed: int = 0, blocks_per_device: int = 56
):
    """(trace, placement, setup, cost) small enough for the exact search: sequences of 8 prompt tokens
    and `mean_output` output tokens on average, 2 layers, 8 experts on 2 devices placed by
    co-activation (topic skew 1.5), blocks of 4, at most 8 running, recompute, optimistic admission."""
    trace, _, placement = skewed_workload(
        num_sequences=num_sequences,
        num_layers=2,
        num_experts=8,
        num_devices=2,
        mean_prompt=8,
        mean_output=mean_output,
        seed=seed,
    )
    setup = RunnerSetup(blocks_per_device=blocks_per_device, block_size=4, max_num_seqs=8)
    return trace, placement, setup, workload_cost_model(trace, setup.block_size)


def compare_with_optimum(instances=OPTIMUM_INSTANCES, blocks_per_device: int = 72) -> list[dict]:
    """Per instance: the optimum over victim choices (search_optimum without pruning, so that the
    worst schedule is known too: a few seconds each), every policy of SIM_POLICIES (steps, modelled
    seconds, evictions) and the memory-time bound."""
    rows = []
    for num_sequences, mean_output, seed in instances:
        trace, placement, setup, cost = small_instance(num_sequences, mean_output, seed, blocks_per_device)
        best = search_optimum(trace, placement, setup, cost, prune=False)
        comparison = compare_policies(trace, placement, setup, cost)
        rows.append(
            {
                "num_sequences": num_sequences,
                "mean_output": mean_output,
                "seed": seed,
                "setup": setup.__dict__,
                "lengths": trace.lengths.tolist(),
                "prompt_lens": trace.prompt_lens.tolist(),
                "optimum": best.summary(),
                "policies": {
                    name: {
                        "steps": s.num_steps,
                        "modelled_seconds": s.seconds,
                        "evictions": s.num_evictions,
                        "recomputed_tokens": s.recomputed_tokens,
                    }
                    for name, s in comparison["stats"].items()
                },
                "bound": comparison["bound"],
            }
        )
    return rows


def format_optimum(rows: list[dict]) -> str:
    """Steps to finish every request, per instance: the optimum, each policy, the bound."""
    names = list(rows[0]["policies"])
    table = [
        [
            f"{r['num_sequences']} seqs, out {r['mean_output']}, seed {r['seed']}",
            r["optimum"]["steps"],
            *(r["policies"][name]["steps"] for name in names),
            r["optimum"]["worst_steps"],
            r["bound"]["steps"],
            r["optimum"]["leaves"],
        ]
        for r in rows
    ]
    return text_table(
        ["instance", "optimum", *names, "worst", "bound", "schedules"],
        table,
        [None] * (len(names) + 3) + ["{:.0f}", None],
    )


def run_optimum(path) -> int:
    rows = compare_with_optimum()
    setup = rows[0]["setup"]
    print(
        f"steps to finish every request: the optimum over victim choices (sim/optimum.py) and each policy; "
        f"2 devices x {setup['blocks_per_device']} blocks of {setup['block_size']}, 2 layers, 8 experts"
    )
    print(format_optimum(rows))
    return _write_json(
        path,
        {
            "objective": "fewest steps to finish every served request, ties by modelled seconds, "
            "over the victim choices only (sim/optimum.py)",
            "instances": rows,
        },
    )


# ----- the program -------------------------------------------------------------------------------------------
SEQUENCES, QUICK_SEQUENCES, BLOCKS_PER_DEVICE, HOST_BLOCKS = 48, 24, 1000, 0  # the defaults


def build_parser(parser=None):
    parser = parser or argparse.ArgumentParser(prog="python -m moekv_ref bench eviction")
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smaller workload ({QUICK_SEQUENCES} sequences) and fewer contexts",
    )
    parser.add_argument(
        "--sequences",
        type=int,
        default=None,
        help=f"requests of the skewed workload (default {SEQUENCES}; not with --quick)",
    )
    parser.add_argument(
        "--blocks-per-device",
        type=int,
        default=None,
        help=f"the trace runner's pool on each of the 4 devices (default {BLOCKS_PER_DEVICE})",
    )
    parser.add_argument(
        "--host-blocks",
        type=int,
        default=None,
        help=f"host swap space in blocks (default {HOST_BLOCKS}: recompute only)",
    )
    parser.add_argument("--skip-measure", action="store_true", help="skip timing the embedded model")
    parser.add_argument("--skip-engine", action="store_true", help="skip the policies on the engine")
    parser.add_argument("--skip-prefix-cache", action="store_true", help="skip prefix caching on the engine")
    parser.add_argument(
        "--only-prefix-cache",
        action="store_true",
        help="run only prefix caching; with --json, update that part of an existing file",
    )
    parser.add_argument(
        "--optimum",
        action="store_true",
        help="run only the exact optimum over victim choices on small instances, beside every policy",
    )
    return parser


def smallest_pool_serving_a_request(trace, placement, block_size: int = 16) -> int:
    """The fewest blocks per device with which at least one request of the trace fits alone (the worst
    case of its lifetime on every device, which the scheduler refuses by): with fewer, every request is
    refused and there is nothing to compare."""
    placement = torch.as_tensor(placement)
    worst = worst_case_lifetime_blocks_per_device(
        trace.lengths.min().view(1),
        int(trace.experts.shape[2]),
        block_size,
        placement[None],
        int(placement.max()) + 1,
    )[0]  # (D,)
    return int(worst.max())


def check_args(args) -> None:
    """Every option, before anything runs. --only-prefix-cache runs one part: the options of the
    others would be ignored, so they are refused. --blocks-per-device must serve at least one request
    of the workload alone (smallest_pool_serving_a_request: the workload is built to find it, ~1 s)."""
    options.output_file("--json", args.json, parents_made=True)
    if args.optimum:
        given = [
            f"--{name.replace('_', '-')}"
            for name in (
                "quick",
                "sequences",
                "blocks_per_device",
                "host_blocks",
                "skip_measure",
                "skip_engine",
                "skip_prefix_cache",
                "only_prefix_cache",
            )
            if getattr(args, name) not in (None, False)
        ]
        if given:
            raise ValueError(
                f"--optimum runs the optimum on its own small instances alone: {', '.join(given)} would "
                "be ignored (give either)"
            )
        return
    if args.only_prefix_cache:
        if args.json is not None and os.path.lexists(args.json):  # read, then updated
            options.input_file("--json", args.json, "a JSON file to update, or a path where none is yet")
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("sequences", "blocks_per_device", "host_blocks", "skip_prefix_cache")
            if getattr(args, name) not in (None, False)
        ]
        if given:
            raise ValueError(
                f"--only-prefix-cache runs prefix caching alone: {', '.join(given)} would be ignored "
                "(give either)"
            )
        return
    if args.quick and args.sequences is not None:
        raise ValueError(
            f"--quick sets its own --sequences ({QUICK_SEQUENCES}): give either --quick or --sequences"
        )
    options.count("--sequences", args.sequences, 1)
    options.count("--blocks-per-device", args.blocks_per_device, 1)
    options.blocks("--host-blocks", args.host_blocks, 0, meaning="0: recompute only, no host swap space")
    if args.blocks_per_device is not None:
        trace, _, placement = skewed_workload(_num_sequences(args))
        least = smallest_pool_serving_a_request(trace, placement)
        options.count(
            "--blocks-per-device",
            args.blocks_per_device,
            least,
            MAX_BLOCKS // int(placement.max() + 1),  # the devices' blocks name one int32 range
            meaning=f"with fewer, none of the {trace.num_sequences} requests fits a device alone",
        )


def _num_sequences(args) -> int:
    return QUICK_SEQUENCES if args.quick else SEQUENCES if args.sequences is None else args.sequences


def main(args) -> int:
    check_args(args)
    torch.set_num_threads(1)
    if args.optimum:
        return run_optimum(args.json)
    if args.only_prefix_cache:  # the other parts of an existing --json file are kept as they are
        out = {}
        if args.json:
            try:
                with open(args.json) as f:
                    out = json.load(f)
            except FileNotFoundError:
                pass
        out["prefix_cache"] = run_prefix_caching(args.quick)
        return _write_json(args.json, out)
    out: dict = {}
    if not args.skip_measure:
        model = load_default_model()
        contexts = [16, 64, 256] if args.quick else [16, 32, 64, 128, 256, 384, 496]
        rows = measure_recompute_and_swap(model, contexts, [4, 16, 64])
        crossovers = measured_crossovers(rows)
        print("recompute vs swap on this machine (embedded model, float32, one thread):")
        print(f"{'P':>4} {'context':>7} {'blocks':>6} {'recompute ms':>12} {'swap ms':>8}")
        for r in rows:
            print(
                f"{r['block_size']:>4} {r['context']:>7} {r['blocks']:>6} {1e3 * r['recompute_seconds']:>12.2f} "
                f"{1e3 * r['swap_seconds']:>8.2f}"
            )
        for P, c in crossovers.items():
            print(f"  P={P}: swap is cheaper from context {c['crossover_context']}")
        out["measured"] = {"rows": rows, "crossovers": {str(k): v for k, v in crossovers.items()}}
    contexts = list(range(8, 4097, 8))
    projected = projected_crossovers([16, 64], contexts)
    print("projected for an H100 at JetMoE-8B's shape, per-expert K/V (50% MFU prefill):")
    for key, value in projected.items():
        print(f"  {key}: swap is cheaper from context {value['crossover_context']}")
    out["projected"] = projected

    num_sequences = _num_sequences(args)
    trace, topic, placement = skewed_workload(num_sequences)
    setup = RunnerSetup(
        blocks_per_device=BLOCKS_PER_DEVICE if args.blocks_per_device is None else args.blocks_per_device,
        block_size=16,
        max_num_seqs=32,
        num_host_blocks=HOST_BLOCKS if args.host_blocks is None else args.host_blocks,
    )
    cost = workload_cost_model(trace, setup.block_size)
    comparison = compare_policies(trace, placement, setup, cost)
    print(
        f"\nskewed workload: {num_sequences} requests, L={trace.num_layers}, E={trace.num_experts}, top-2, "
        f"D=4 devices x {setup.blocks_per_device} blocks of {setup.block_size}, co-activation placement, "
        f"host swap {setup.num_host_blocks} blocks; cost model: {cost.name}"
    )
    print(format_comparison(comparison))
    out["workload"] = {
        "num_sequences": num_sequences,
        "setup": setup.__dict__,
        "cost_model": cost.to_dict(),
        "policies": {k: v.summary() for k, v in comparison["stats"].items()},
        "bound": comparison["bound"],
    }

    if not args.skip_engine:
        model = load_default_model()
        requests = make_workload(12 if args.quick else 24, prompt_len=(8, 48), output_len=(48, 96), seed=0)
        placement_engine = engine_placement(model, requests)
        blocks = [72] * 4
        engine = compare_engine_policies(model, requests, blocks, placement_engine, block_size=16)
        print(
            f"\nthe engine, embedded model: {len(requests)} requests, D=4 x {blocks[0]} blocks of 16, the most "
            "popular experts of each layer on device 0, optimistic admission, recompute"
        )
        print(format_engine_comparison(engine))
        out["engine"] = {
            "num_requests": len(requests),
            "blocks_per_device": blocks,
            "block_size": 16,
            "placement": placement_engine.tolist(),
            **engine,
        }

    density = density_sweep(experts=(8, 16, 64), top_ks=(1, 2, 8), skews=(0.0, 1.0, 2.0), context=64)
    print("\ndensity: mean fraction of a batch's sequences an expert buffer holds (context 64 tokens)")
    for row in density:
        print(
            f"  E={row['num_experts']:>3} k={row['top_k']} zipf_s={row['zipf_s']:.1f}: mean {row['mean']:.3f}, "
            f"coldest expert {row['min']:.3f}"
        )
    out["density"] = density
    if not args.skip_prefix_cache:
        out["prefix_cache"] = run_prefix_caching(args.quick)
    return _write_json(args.json, out)


def _write_json(path, out: dict) -> int:
    if path:
        with open(output_path(path), "w") as f:
            dump(out, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(options.parse_checked(build_parser(), check=check_args)))
