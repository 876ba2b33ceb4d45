"""`python -m moekv_ref bench parallel`: what travels between ranks under expert parallelism.

Four parts, printed and (with --json PATH) saved:

1. bytes per decode step at growing contexts, for each KV placement, measured by the Communicator's
   counters on real process groups (gloo on CPU); weight bytes per rank; the measured split of a
   decode step into communication and the rest (on this machine: CPU processes, so only the
   proportions within one run mean anything)
2. per-rank pool use after the longest context
3. expert placements compared on the embedded model's real attention routing
4. the cost model: its bytes against the measured ones for every run above, then projected decode
   step times for real shapes at 4k and 32k context, with the hardware figures and their sources
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from ..checkpoint import load_default_model
from ..config import ModelConfig
from ..costs import measured_shape_bytes, real_shape_projections
from ..jsonout import dump
from ..parallel.kv_placements import KV_PLACEMENTS
from ..parallel.launcher import FAULT_ENV, fault_from_environment
from ..parallel.locality import attention_routing_of_text, compare_placements, format_placement_table
from ..parallel.programs import run_parallel, total_bytes, total_traffic
from ..paths import output_path
from ..plots.tables import text_table
from . import options as checks
from . import parallel_options as options
from .parallel_measure import bytes_table, context_sweep_specs, pool_table

WORLD_SIZES = tuple(w for w in options.WORLD_SIZES if w >= 2)  # a sweep of one rank moves nothing
# a collective's wait for a peer, kept generous (not the launcher's 15 s): --contexts up to 4095 on 8
# ranks of a loaded 2-core machine can keep peers waiting far longer than the ~1 s measured at 4 ranks
# and context 2048, and a benchmark is not where hangs are caught
COLLECTIVE_TIMEOUT_S = 120


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="python -m moekv_ref bench parallel", description=__doc__)
    parser.add_argument(
        "--world-size", type=int, default=4, help=f"ranks (processes) to start: {options.one_of(WORLD_SIZES)}"
    )
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[128, 512, 2048],
        help=f"context lengths of the sweep (each from 1 to {options.MAX_POSITIONS} minus --decode-steps)",
    )
    parser.add_argument(
        "--decode-steps", type=int, default=2, help="decode steps measured per context (at least 1)"
    )
    parser.add_argument(
        "--json", default=None, help="write every figure to this JSON file (its folder must exist)"
    )
    return parser


def check_args(args) -> None:
    """Every option, before anything starts: a ValueError naming the first bad one (cli.main turns it
    into parser.error, exit status 2)."""
    problem = options.world_size_problem(args.world_size, WORLD_SIZES, " (and one rank would move nothing)")
    if problem:
        raise ValueError(f"--world-size {args.world_size}: {problem}")
    for problem in options.positions_problems(args.contexts, args.decode_steps, "--contexts"):
        raise ValueError(problem)
    checks.distinct("--contexts", args.contexts, "each context of the sweep runs once")
    checks.output_file("--json", args.json, parents_made=True)
    check_fault(args.world_size)


def check_fault(world_size: int) -> None:
    """MOEKV_FAULT (test-only fault injection) as this program honours it: slow_start, which every
    launch applies as its ranks join, and nothing else (a fault at a decode step would stop the sweep,
    so the faults at a step belong to parallel_run, one run of it)."""
    fault = fault_from_environment()  # a malformed value: its own ValueError
    if fault is None:
        return
    value = f"{FAULT_ENV}={os.environ[FAULT_ENV].strip()}"
    if fault.mode != "slow_start":
        raise ValueError(
            f"{value}: bench parallel injects only slow_start faults; {fault.mode!r} at a decode step is "
            f"injected by `python -m moekv_ref.apps.parallel_run` (or the same under torchrun): unset "
            f"{FAULT_ENV} here"
        )
    if fault.rank >= world_size:
        raise ValueError(
            f"{value}: rank {fault.rank} does not exist: the ranks are 0 to {world_size - 1} "
            f"(--world-size {world_size})"
        )


def run_sweep(world_size: int, contexts, decode_steps: int):
    specs = context_sweep_specs(world_size, tuple(contexts), num_decode_steps=decode_steps)
    runs = run_parallel(specs, world_size, timeout_s=COLLECTIVE_TIMEOUT_S)
    return specs, runs


def cost_model_check(specs, runs) -> list[dict]:
    """For every step of every run: the cost model's bytes minus the measured ones (0 everywhere)."""
    rows = []
    for spec, results in zip(specs, runs):
        config = ModelConfig.from_dict(spec.model.config)
        for step in range(spec.num_decode_steps + 1):
            measured = total_bytes(results, step)
            modelled = measured_shape_bytes(
                config, spec.kv_placement, len(results), total_traffic(results, step), 4
            )
            modelled = {c: b for c, b in modelled.items() if b}
            rows.append(
                {
                    "label": spec.label,
                    "step": step,
                    "measured": sum(measured.values()),
                    "modelled": sum(modelled.values()),
                    "equal": measured == modelled,
                }
            )
    return rows


def format_bytes_table(rows: list[dict]) -> str:
    return text_table(
        ["placement", "context", "bytes/step", "attention", "ffn", "attn weights/rank", "step ms", "comm ms"],
        [
            [
                r["kv_placement"],
                r["context"],
                r["bytes_per_decode_step"],
                r["attention_bytes"],
                r["ffn_bytes"],
                r["attention_weight_bytes_per_rank"][0],
                r["decode_step_ms"],
                r["communication_ms"],
            ]
            for r in rows
        ],
        [None, "{}", "{:.0f}", "{:.0f}", "{:.0f}", "{}", "{:.1f}", "{:.1f}"],
    )


def ratios(rows: list[dict]) -> dict[int, float]:
    """kv_with_sequence / kv_with_expert bytes per decode step, per context."""
    by = {(r["kv_placement"], r["context"]): r["bytes_per_decode_step"] for r in rows}
    return {
        context: by[("kv_with_sequence", context)] / by[("kv_with_expert", context)]
        for (placement, context) in by
        if placement == "kv_with_expert" and ("kv_with_sequence", context) in by
    }


def format_projections(rows: list[dict]) -> str:
    return text_table(
        [
            "model",
            "placement",
            "GPUs",
            "link",
            "context",
            "MB/step",
            "attn ms",
            "experts ms",
            "comm ms",
            "step ms",
        ],
        [
            [
                r["model"],
                r["kv_placement"],
                r["world_size"],
                r["interconnect"],
                r["context"],
                sum(r["bytes_per_step"].values()) / 1e6,
                r["attention_ms"],
                r["experts_ms"],
                r["communication_ms"],
                r["step_ms"],
            ]
            for r in rows
        ],
        [None, None, "{}", None, "{}", "{:.1f}", "{:.3f}", "{:.3f}", "{:.3f}", "{:.3f}"],
    )


def main(args) -> int:
    torch.set_num_threads(1)
    start = time.perf_counter()
    specs, runs = run_sweep(args.world_size, args.contexts, args.decode_steps)
    rows = [bytes_table(spec, results) for spec, results in zip(specs, runs)]
    print(
        f"1. Bytes per decode step, {args.world_size} ranks, summed over ranks (measured by the counters; "
        f"{args.world_size} sequences, one per rank)"
    )
    print(format_bytes_table(rows))
    ratio = ratios(rows)
    print("kv_with_sequence / kv_with_expert: " + ", ".join(f"{c}: {r:.1f}x" for c, r in ratio.items()))
    longest = max(args.contexts)
    pools = {
        spec.kv_placement: pool_table(results)
        for spec, results in zip(specs, runs)
        if len(spec.prompts[0]) == longest
    }
    print(f"\n2. Blocks used per rank after the last step, context {longest}")
    for placement, per_rank in pools.items():
        print(
            f"  {placement:<21} "
            + "  ".join(
                f"rank {r}: {steps[-1]['used_blocks']}/{steps[-1]['num_blocks']}"
                for r, steps in enumerate(per_rank)
            )
        )
    print(
        "\n3. Expert placements on the embedded model's attention routing (held-out text; bytes: hidden "
        "states per token per layer, float32)"
    )
    model = load_default_model()
    placements = compare_placements(attention_routing_of_text(model), hidden_size=model.config.hidden_size)
    print(format_placement_table(placements))
    check = cost_model_check(specs, runs)
    print(
        f"\n4. Cost model: bytes equal the measured ones in {sum(r['equal'] for r in check)} of {len(check)} steps"
    )
    projections = real_shape_projections()
    print(format_projections(projections))
    print("sources: " + "; ".join(sorted({s for p in projections for s in p["sources"].values()})))
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        with open(output_path(args.json), "w") as handle:
            dump(
                {
                    "world_size": args.world_size,
                    "bytes_per_decode_step": rows,
                    "kv_with_sequence_over_kv_with_expert": {str(c): r for c, r in ratio.items()},
                    "pools_after_longest_context": pools,
                    "expert_placements": placements,
                    "cost_model_check": check,
                    "projections": projections,
                    "kv_placements": list(KV_PLACEMENTS),
                },
                handle,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0
