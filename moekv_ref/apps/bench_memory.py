"""`python -m moekv_ref bench memory`: the same workloads through every memory design, in one run.

Workloads:
  W1  the embedded model's real attention routing (E=8, top-2, 4 layers) on a fixed set of prompts,
      continued greedily;
  W2  synthetic, fine-grained: E=64, top-8, 16 layers, log-normal prompt and output lengths of mean
      256 each, Zipf(s=1) expert popularity -- every (sequence, layer, expert) has a partly filled
      last block, the hard case for paging;
  W3  synthetic, Mixtral-like count: E=8, top-2, 16 layers, the same lengths and skew.

Designs: `paged` (plain per-row pages, the real KVCacheManager, what the model uses by default),
`paged_shared_tail` (private full blocks, tails shared within a sequence:
cache/shared_tail_manager.py, measured through its count-level model sim/designs.SharedTailDesign),
`reserved` and `first_fit` (cache/baselines.py).

Metrics (sim/replay.py): utilization and effective_utilization over a lock-step replay of the whole
workload; max_concurrent_sequences = the most sequences (the workload's first n) a design holds at
once, run to completion, under one budget shared by all designs: the live KV bytes of the first
`budget_sequences` sequences at their final length, i.e. what a perfect allocator would need for them.

Also: a block-size sweep (1..256) and an expert-count sweep, with what each choice costs (tail
waste, metadata bytes, contiguous runs a decode token reads), and the simulator's speed driving the
real KVCacheManager.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure

from ..analysis import record_model_trace
from ..checkpoint import DEFAULT_CHECKPOINT, load_default_model
from ..config import get_config
from ..jsonout import write
from ..model import MoEKVTransformer
from ..plots.memory import plot_block_size_sweep, plot_num_experts_sweep
from ..sim.contiguous_designs import FirstFitDesign, ReservedDesign
from ..sim.designs import CountingPagedDesign, ManagerPagedDesign, SharedTailDesign
from ..sim.replay import max_concurrent_sequences, replay
from ..sim.traces import RoutingTrace, synthetic_trace
from . import options

DEFAULT_BLOCK_SIZE = 16
TARGET_EFFECTIVE_UTILIZATION = 0.96
TARGET_CONCURRENCY_OVER_RESERVED = 3  # paged holds at least 3x the sequences reserved holds on W2
TARGET_SLOT_APPENDS_PER_SECOND = 5e6  # the simulator driving the real KVCacheManager
DEFAULT_JSON = "runs/bench_memory.json"  # `python -m moekv_ref figures` writes figures/bench_memory.json

# W1: short code-like prompts, the kind of text the embedded model was trained on.
W1_PROMPTS = [
    "def ",
    "import torch\n",
    "class Cache:\n    def __init__(self",
    "for i in range(",
    "# compute the mean\n",
    "def forward(self, x):\n    ",
    "return ",
    "if __name__ == ",
    "x = torch.zeros(",
    "with open(path) as f:\n",
    "    def free(self, seq_id):\n",
    '"""A block pool',
    "from dataclasses import dataclass\n",
    "while True:\n    ",
    "assert ",
    "def attend(q, k, v):\n",
]


def w1_output_lens(num_prompts: int) -> list[int]:
    """Fixed, varied output lengths: 48, 80, ..., so that sequences end at different steps."""
    return [48 + 32 * (i % 6) for i in range(num_prompts)]


def workload_w1(num_prompts: int = 16) -> tuple[RoutingTrace, str]:
    """The embedded model's routing; random weights (and a note) if the checkpoint is missing."""
    if DEFAULT_CHECKPOINT.exists():
        model, source = load_default_model(), "embedded checkpoint"
    else:
        torch.manual_seed(0)
        model, source = MoEKVTransformer(get_config("tiny")).eval(), "random weights (no checkpoint)"
    prompts = [list(p.encode()) for p in W1_PROMPTS[:num_prompts]]
    return record_model_trace(model, prompts, w1_output_lens(len(prompts)), name="W1"), source


def workload_w2(num_sequences: int = 64, seed: int = 2) -> RoutingTrace:
    return synthetic_trace(
        num_sequences,
        num_layers=16,
        num_experts=64,
        top_k=8,
        mean_prompt=256,
        mean_output=256,
        zipf_s=1.0,
        seed=seed,
        name="W2",
    )


def workload_w3(num_sequences: int = 64, seed: int = 3) -> RoutingTrace:
    return synthetic_trace(
        num_sequences,
        num_layers=16,
        num_experts=8,
        top_k=2,
        mean_prompt=256,
        mean_output=256,
        zipf_s=1.0,
        seed=seed,
        name="W3",
    )


def design_factories(trace: RoutingTrace, block_size: int) -> dict:
    """name -> make(num_sequences) for every design compared on a trace."""
    L, E = trace.num_layers, trace.num_experts

    def paged(n):
        # enough blocks that memory never runs out: every slot in its own block, at worst
        num_blocks = trace.num_slot_appends // block_size + n * L * E + 1
        return ManagerPagedDesign(n, L, E, block_size, num_blocks)

    return {
        "paged": paged,
        "paged_shared_tail": lambda n: SharedTailDesign(n, L, E, block_size),
        "reserved": lambda n: ReservedDesign(n, L, E),
        "first_fit": lambda n: FirstFitDesign(n, L, E),
    }


def budget_bytes(trace: RoutingTrace, budget_sequences: int) -> int:
    """Live KV bytes of the first `budget_sequences` sequences at their final length."""
    first = trace.subset(list(range(min(budget_sequences, trace.num_sequences))))
    return first.num_slot_appends * trace.kv_bytes_per_slot


def evaluate_workload(
    trace: RoutingTrace,
    block_size: int = DEFAULT_BLOCK_SIZE,
    budget_sequences: int = 16,
    designs: list[str] | None = None,
) -> dict:
    """Every design on one trace: utilization, effective_utilization, max_concurrent_sequences."""
    budget = budget_bytes(trace, budget_sequences)
    results = {}
    for name, make in design_factories(trace, block_size).items():
        if designs is not None and name not in designs:
            continue
        design = make(trace.num_sequences)
        stats = replay(trace, design, count_reads=True)
        results[name] = {
            "utilization": stats.utilization,
            "effective_utilization": stats.effective_utilization,
            "max_concurrent_sequences": max_concurrent_sequences(trace, make, budget),
            "peak_bytes": stats.peak_bytes,
            "reads_per_decode_token": stats.reads_per_decode_token,
        }
        if hasattr(design, "copied_slots"):  # the price of shared tails: extra K/V writes
            results[name]["copied_slots_per_slot_append"] = design.copied_slots / stats.slot_appends
    return {
        "results": results,
        "budget_bytes": budget,
        "num_sequences": trace.num_sequences,
        "slot_appends": trace.num_slot_appends,
        "kv_bytes_per_slot": trace.kv_bytes_per_slot,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "top_k": trace.experts.shape[2],
    }


def sweep_block_sizes(trace: RoutingTrace, block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """Plain pages and shared tails at each block size: what each choice costs."""
    L, E = trace.num_layers, trace.num_experts
    rows = []
    for P in block_sizes:
        for name, design in (
            ("paged", CountingPagedDesign(trace.num_sequences, L, E, P)),
            ("paged_shared_tail", SharedTailDesign(trace.num_sequences, L, E, P)),
        ):
            stats = replay(trace, design, count_reads=True)
            rows.append(
                {
                    "block_size": P,
                    "design": name,
                    "utilization": stats.utilization,
                    "effective_utilization": stats.effective_utilization,
                    "tail_waste": 1 - stats.utilization,
                    "metadata_fraction": stats.metadata_bytes_time_sum
                    / max(1, stats.allocated_bytes_time_sum + stats.metadata_bytes_time_sum),
                    "reads_per_decode_token": stats.reads_per_decode_token,
                    "copied_slots_per_slot_append": getattr(design, "copied_slots", 0) / stats.slot_appends,
                }
            )
    return rows


def largest_block_size_reaching(
    trace: RoutingTrace, target: float = TARGET_EFFECTIVE_UTILIZATION, block_sizes=(1, 2, 4, 8, 16, 32, 64)
) -> int | None:
    """The largest block size at which plain per-row pages keep effective_utilization >= target on
    this trace (None if even P = 1 does not)."""
    L, E = trace.num_layers, trace.num_experts
    reaching = [
        P
        for P in block_sizes
        if replay(trace, CountingPagedDesign(trace.num_sequences, L, E, P)).effective_utilization >= target
    ]
    return max(reaching) if reaching else None


def sweep_num_experts(
    num_experts_list=(8, 16, 32, 64, 128),
    block_size: int = DEFAULT_BLOCK_SIZE,
    top_k: int = 2,
    num_sequences: int = 16,
    num_layers: int = 16,
    zipf_s: float = 1.0,
    seed: int = 4,
) -> list[dict]:
    """More experts at a fixed top-k and block size: the same KV per token spread over more, shorter
    rows, each with its own partly filled last block. (With top-k = E / 8 instead, rows keep their
    length and plain pages keep their utilization: it is tokens per row that matters.)"""
    rows = []
    for E in num_experts_list:
        k = min(top_k, E)
        trace = synthetic_trace(num_sequences, num_layers, E, k, zipf_s=zipf_s, seed=seed)
        for name, design in (
            ("paged", CountingPagedDesign(num_sequences, num_layers, E, block_size)),
            ("paged_shared_tail", SharedTailDesign(num_sequences, num_layers, E, block_size)),
        ):
            stats = replay(trace, design)
            rows.append(
                {
                    "num_experts": E,
                    "top_k": k,
                    "design": name,
                    "tokens_per_row": int(trace.lengths.float().mean()) * k / E,
                    "utilization": stats.utilization,
                    "effective_utilization": stats.effective_utilization,
                }
            )
    return rows


def compare_designs(
    num_experts: int = 64,
    block_size: int = DEFAULT_BLOCK_SIZE,
    zipf_s: float = 1.0,
    num_sequences: int = 8,
    num_layers: int = 4,
    mean_length: float = 128,
    seed: int = 0,
) -> dict:
    """Utilization of every design on a small synthetic trace (top-k = E / 8): what the notebook's
    sliders call. Returns {design: {"utilization": .., "effective_utilization": ..}}."""
    trace = synthetic_trace(
        num_sequences,
        num_layers,
        num_experts,
        max(1, num_experts // 8),
        mean_prompt=mean_length / 2,
        mean_output=mean_length / 2,
        zipf_s=zipf_s,
        seed=seed,
    )
    results = {}
    for name, make in design_factories(trace, block_size).items():
        stats = replay(trace, make(num_sequences))
        results[name] = {
            "utilization": stats.utilization,
            "effective_utilization": stats.effective_utilization,
        }
    return results


def simulator_speed(trace: RoutingTrace, block_size: int = DEFAULT_BLOCK_SIZE, repeats: int = 3) -> dict:
    """Slot appends per second of a replay driving the real KVCacheManager (best of `repeats`)."""
    make = design_factories(trace, block_size)["paged"]
    best = min(replay(trace, make(trace.num_sequences)).seconds for _ in range(repeats))
    return {
        "slot_appends_per_second": trace.num_slot_appends / best,
        "slot_appends": trace.num_slot_appends,
        "seconds": best,
        "workload": trace.name,
        "design": "paged (KVCacheManager)",
    }


def run(block_size: int = DEFAULT_BLOCK_SIZE, quick: bool = False) -> dict:
    """The whole benchmark as one dict: per workload and design, utilization and concurrency, then
    the block-size and expert-count sweeps (what figures/bench_memory.json holds)."""
    # Bookkeeping ops are small: extra threads only contend on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        num_sequences = 16 if quick else 64
        w1, w1_source = workload_w1(8 if quick else 16)
        traces = {"W1": w1, "W2": workload_w2(num_sequences), "W3": workload_w3(num_sequences)}
        return build_report(traces, block_size, w1_source, speed_repeats=1 if quick else 3)
    finally:
        torch.set_num_threads(threads)


def build_report(
    traces: dict[str, RoutingTrace],
    block_size: int = DEFAULT_BLOCK_SIZE,
    w1_source: str = "",
    speed_repeats: int = 3,
    sweep_sequences: int = 16,
) -> dict:
    """Evaluate the traces {"W1": .., "W2": .., "W3": ..}, the sweeps and the simulator's speed.
    The budget for max_concurrent_sequences is a quarter of each workload's sequences."""
    report = {
        "block_size": block_size,
        "workloads": {},
        "notes": {
            "W1": f"routing recorded from {w1_source}",
            "paged": "plain per-(sequence, layer, expert) pages through the real KVCacheManager; "
            "what the model's PagedKVCache uses",
            "paged_shared_tail": "private full blocks, each row's partial tail in tail blocks shared by the "
            "sequence's rows at token granularity (cache/shared_tail_manager.py; the "
            "model runs it with SharedTailPagedKVCache, torch backend only). "
            "Numbers from its count-level model sim/designs.SharedTailDesign, which a "
            "test checks against the real manager step by step",
            "max_concurrent_sequences": "first n sequences started together and run to completion, "
            "allocated + metadata bytes <= budget_bytes throughout",
            "reserved": "oracle worst case: knows each sequence's final length",
        },
    }
    for name, trace in traces.items():
        budget_sequences = max(1, trace.num_sequences // 4)
        results = evaluate_workload(trace, block_size, budget_sequences)["results"]
        report["workloads"][name] = results | {
            "workload": _describe(trace, budget_sequences),
            "paged_largest_block_size_reaching_target": largest_block_size_reaching(trace),
        }
    report["simulator"] = simulator_speed(traces["W2"], block_size, repeats=speed_repeats)
    sweep_trace = traces["W2"].subset(list(range(min(sweep_sequences, traces["W2"].num_sequences))))
    report["block_size_sweep"] = {
        "workload": f"W2 (first {sweep_trace.num_sequences} sequences)",
        "rows": sweep_block_sizes(sweep_trace),
    }
    report["num_experts_sweep"] = {
        "block_size": block_size,
        "rows": sweep_num_experts(num_sequences=sweep_sequences // 2),
    }
    report["targets"] = _targets(report)
    return report


def _describe(trace: RoutingTrace, budget_sequences: int) -> dict:
    return {
        "num_sequences": trace.num_sequences,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "top_k": trace.experts.shape[2],
        "mean_length": float(trace.lengths.float().mean()),
        "slot_appends": trace.num_slot_appends,
        "kv_bytes_per_slot": trace.kv_bytes_per_slot,
        "budget_bytes": budget_bytes(trace, budget_sequences),
        "budget_sequences": budget_sequences,
    }


def _targets(report: dict) -> dict:
    """The benchmark's targets (utilization, concurrency, simulator speed), per design, true or false:
    no number is hidden."""
    workloads = report["workloads"]
    return {
        f"{design}_effective_utilization_ge_{TARGET_EFFECTIVE_UTILIZATION}": {
            name: workloads[name][design]["effective_utilization"] >= TARGET_EFFECTIVE_UTILIZATION
            for name in workloads
        }
        for design in ("paged", "paged_shared_tail")
    } | {
        "paged_max_concurrent_ge_3x_reserved_on_W2": workloads["W2"]["paged"]["max_concurrent_sequences"]
        >= TARGET_CONCURRENCY_OVER_RESERVED * workloads["W2"]["reserved"]["max_concurrent_sequences"],
        "simulator_ge_5M_slot_appends_per_second": report["simulator"]["slot_appends_per_second"]
        >= TARGET_SLOT_APPENDS_PER_SECOND,
    }


def format_goals(report: dict) -> list[str]:
    """The lines that close the table: each goal of report["targets"], what was measured against it
    and whether it was reached. A goal not reached is a finding about a design (plain pages waste a
    partly filled block per row) or this machine (the simulator's speed), not a failed run."""
    workloads = report["workloads"]
    targets = report["targets"]

    def reached(flag: bool) -> str:
        return "reached" if flag else "not reached"

    lines = ["measured against the design goals (a goal not reached is a finding, not an error):"]
    for design in ("paged", "paged_shared_tail"):
        flags = targets[f"{design}_effective_utilization_ge_{TARGET_EFFECTIVE_UTILIZATION}"]
        measured = ", ".join(
            f"{name} {workloads[name][design]['effective_utilization']:.3f} ({reached(flags[name])})"
            for name in workloads
        )
        lines.append(
            f"  {design} effective utilization (goal {TARGET_EFFECTIVE_UTILIZATION} or more): {measured}"
        )
    paged = workloads["W2"]["paged"]["max_concurrent_sequences"]
    reserved = workloads["W2"]["reserved"]["max_concurrent_sequences"]
    lines.append(
        f"  paged sequences held at once on W2: {paged}, against reserved's {reserved} (goal "
        f"{TARGET_CONCURRENCY_OVER_RESERVED}x as many or more: "
        f"{reached(targets['paged_max_concurrent_ge_3x_reserved_on_W2'])})"
    )
    speed = report["simulator"]["slot_appends_per_second"]
    lines.append(
        f"  simulator on this machine: {speed / 1e6:.1f} M slot appends/s (goal "
        f"{TARGET_SLOT_APPENDS_PER_SECOND / 1e6:g} M or more: "
        f"{reached(targets['simulator_ge_5M_slot_appends_per_second'])})"
    )
    return lines


def format_table(report: dict) -> str:
    designs = ["paged", "paged_shared_tail", "reserved", "first_fit"]
    lines = [
        f"block size {report['block_size']}",
        f"{'workload':8} {'design':18} {'utilization':>11} {'effective':>9} {'max seqs':>8} {'reads/token':>11}",
    ]
    for name, workload in report["workloads"].items():
        for design in designs:
            r = workload[design]
            lines.append(
                f"{name:8} {design:18} {r['utilization']:11.3f} {r['effective_utilization']:9.3f} "
                f"{r['max_concurrent_sequences']:8d} {r['reads_per_decode_token']:11.1f}"
            )
        lines.append(
            f"{name:8} plain pages reach {TARGET_EFFECTIVE_UTILIZATION} up to block size "
            f"{workload['paged_largest_block_size_reaching_target']}; budget "
            f"{workload['workload']['budget_bytes'] / 2**20:.0f} MiB"
        )
    sim = report["simulator"]
    lines.append(
        f"simulator: {sim['slot_appends_per_second'] / 1e6:.1f} M slot appends/s "
        f"({sim['slot_appends']} appends, {sim['design']}, {sim['workload']})"
    )
    lines.append("")
    lines.append(f"block-size sweep ({report['block_size_sweep']['workload']})")
    lines.append(
        f"{'P':>4} {'design':18} {'utilization':>11} {'effective':>9} {'metadata':>8} "
        f"{'reads/token':>11} {'copies/append':>13}"
    )
    for row in report["block_size_sweep"]["rows"]:
        lines.append(
            f"{row['block_size']:4d} {row['design']:18} {row['utilization']:11.3f} "
            f"{row['effective_utilization']:9.3f} {row['metadata_fraction']:8.4f} "
            f"{row['reads_per_decode_token']:11.1f} {row['copied_slots_per_slot_append']:13.3f}"
        )
    lines.append("")
    lines.extend(format_goals(report))
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m moekv_ref bench memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=DEFAULT_JSON,
        help=f"where to write the report as JSON (default {DEFAULT_JSON}, its folder made if missing; "
        "`python -m moekv_ref figures` rewrites the committed figures/bench_memory.json)",
    )
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--quick", action="store_true", help="fewer sequences (for tests and a first look)")
    parser.add_argument(
        "--figures", metavar="DIR", default=None, help="also draw the sweeps as PNGs into DIR (e.g. figures/)"
    )
    return parser


def check_args(args) -> None:
    """--block-size is a power of two; --figures a folder and --json a file (both made if missing)."""
    options.block_size("--block-size", args.block_size)
    options.folder("--figures", args.figures)
    options.output_file("--json", args.json, parents_made=True)


def run_bench_memory(args) -> int:
    check_args(args)
    started = time.perf_counter()
    report = run(args.block_size, quick=args.quick)
    report["seconds"] = time.perf_counter() - started
    print(format_table(report))
    if args.json:
        write(args.json, report, indent=1)
        print(f"wrote {args.json}")
    if args.figures:
        save_figures(report, Path(args.figures))
    return 0


def save_figures(report: dict, directory: Path) -> list[Path]:
    """The block-size and expert-count sweeps of a report as PNGs."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    fig = Figure(figsize=(12, 3.8))
    (left, right) = fig.subplots(1, 2)
    plot_block_size_sweep(left, report["block_size_sweep"]["rows"], "effective_utilization")
    plot_block_size_sweep(right, report["block_size_sweep"]["rows"], "reads_per_decode_token")
    right.set_yscale("log")
    fig.suptitle(
        f"block size: memory kept vs pieces a decode reads ({report['block_size_sweep']['workload']})"
    )
    fig.tight_layout()
    paths.append(directory / "bench_memory_block_size.png")
    fig.savefig(paths[-1], dpi=110)
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.subplots()
    plot_num_experts_sweep(ax, report["num_experts_sweep"]["rows"])
    ax.set_title(f"number of experts at block size {report['num_experts_sweep']['block_size']}")
    fig.tight_layout()
    paths.append(directory / "bench_memory_num_experts.png")
    fig.savefig(paths[-1], dpi=110)
    return paths


def main(argv=None) -> int:
    return run_bench_memory(options.parse_checked(build_parser(), argv, check_args))


if __name__ == "__main__":
    raise SystemExit(main())
