"""`python -m moekv_ref demo`: serve a stream of requests on the embedded model through a deliberately
small pool of KV blocks, and show what the scheduler did.

Requests arrive over time (a Poisson process counted in engine steps) with widely varying prompt and
output lengths; attention routing is dynamic (threshold), so how many blocks a request will need is
known only as its tokens are routed. The pool holds a fraction of what serving everything at once
would take. The engine admits on a prediction of demand, reserves each step's worst case, preempts
whole sequences when the pool runs short and resumes them later -- and every request still gets
exactly the tokens it would get alone. One request is too large for the pool and is refused up front.

Prints a summary (steps; requests admitted, preempted, resumed, refused; pool use over time; predicted
against actual demand) and writes figures/demo_serving_*.png. By default it serves the stream twice:
admitting on the prediction, and admitting whenever the next step fits (vLLM's rule) for contrast --
the prediction avoids preemptions, the optimistic rule keeps the pool fuller and recovers by
preempting.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import matplotlib
import torch
from tqdm import tqdm

from ..checkpoint import load_default_model
from ..config import get_config
from ..demo_workload import demo_workload, serve_workload
from ..engine import LLMEngine
from ..plots.serving import demand_table, plot_run, pool_use
from . import options

FIGURES = Path("figures")
SPARK = " ▁▂▃▄▅▆▇█"


def explore(
    arrival_rate: float = 0.5,
    num_blocks: int = 200,
    routing: str = "threshold",
    preemption_mode: str = "recompute",
    admission: str = "predicted",
    num_requests: int = 12,
    seed: int = 0,
):
    """One serving run for notebook 04's widgets: the demo workload at this arrival rate through a
    pool of `num_blocks`, with this routing and preemption mode. Returns (summary, engine)."""
    return run_demo(
        num_requests,
        num_blocks,
        preemption_mode,
        admission,
        arrival_rate,
        seed,
        figures=None,
        progress=False,
        model=_explore_model(routing),
    )


@functools.lru_cache(maxsize=None)
def _explore_model(routing: str):
    """explore's model for each routing, loaded once: a redraw of the widget then loads none (the
    load was 2% of one, measured). Serving only reads it."""
    return load_default_model(routing)


def sparkline(values, width: int = 60, top: float | None = None) -> str:
    """Values as a row of block characters, each the maximum of its share of the run."""
    values = list(values)
    if not values:
        return ""
    top = top or max(values) or 1
    buckets = [
        values[i * len(values) // width : max((i + 1) * len(values) // width, i * len(values) // width + 1)]
        for i in range(min(width, len(values)))
    ]
    return "".join(SPARK[min(len(SPARK) - 1, round(max(b) / top * (len(SPARK) - 1)))] for b in buckets)


def summarize(engine: LLMEngine, result) -> dict:
    """The numbers the demo prints, as plain values (rounded so that they reproduce)."""
    stats = engine.stats()
    use = pool_use(engine)
    table = demand_table(engine)
    predicted = sum(r["predicted_blocks"] for r in table)
    actual = sum(r["actual_blocks"] for r in table)
    k_avg = [round(k, 2) for k in engine.predictor.k_avg.tolist()]
    return {
        "steps": stats.num_steps,
        "requests": len(result.outputs) + len(result.refused),
        "admitted": stats.num_admitted,
        "preempted": stats.num_preemptions,
        "resumed": stats.num_resumed,
        "finished": stats.num_finished,
        "refused": len(result.refused),
        "recomputed_tokens": stats.num_recomputed_tokens,
        "swapped_out_blocks": stats.num_swapped_out_blocks,
        "generated_tokens": stats.num_generated_tokens,
        "pool_blocks": engine.memory.num_blocks,
        "block_size": engine.memory.block_size,
        "sum_of_actual_demand_blocks": actual,
        "pool_fraction_of_all_at_once": round(engine.memory.num_blocks / max(actual, 1), 3),
        "peak_used_blocks": int(use["used_blocks"].max(initial=0)),
        "mean_used_fraction": round(float(use["used_blocks"].mean()) / engine.memory.num_blocks, 3),
        "max_concurrent_sequences": stats.max_concurrent_sequences,
        "experts_per_token_per_layer": k_avg,
        "predicted_over_actual": round(predicted / max(actual, 1), 3),
        "admission_uses_prediction": engine.scheduler.batching.admits_on_prediction(),
        "refusals": list(result.refused.values()),
    }


def format_summary(summary: dict, engine: LLMEngine) -> str:
    use = pool_use(engine)
    lines = [
        f"steps {summary['steps']}: {summary['requests']} requests, {summary['admitted']} admitted, "
        f"{summary['preempted']} preemptions, {summary['resumed']} resumed, {summary['finished']} finished, "
        f"{summary['refused']} refused",
        f"generated {summary['generated_tokens']} tokens; recomputed {summary['recomputed_tokens']} tokens; "
        f"swapped out {summary['swapped_out_blocks']} blocks",
        f"pool: {summary['pool_blocks']} blocks of {summary['block_size']} slots"
        + (
            f" = {summary['pool_fraction_of_all_at_once']:.0%} of the blocks the requests held in the end "
            f"({summary['sum_of_actual_demand_blocks']})"
            if summary["sum_of_actual_demand_blocks"]
            else ""
        ),
        f"pool use over time (peak {summary['peak_used_blocks']}, mean {summary['mean_used_fraction']:.0%}, "
        f"max {summary['max_concurrent_sequences']} sequences at once):",
        f"  blocks    |{sparkline(use['used_blocks'], top=engine.memory.num_blocks)}|",
        f"  running   |{sparkline(use['num_running'])}|",
        f"  preempted |{sparkline(use['num_preempted'])}|",
        f"routing: experts per token per layer {summary['experts_per_token_per_layer']} "
        f"(k_max {engine.config.num_attention_experts_per_tok})",
    ]
    if summary["admission_uses_prediction"]:
        lines.append(
            f"admission predicted {summary['predicted_over_actual']:.2f}x the blocks routing then needed "
            "(k_avg entries plus the bound of P - 1 wasted slots per row)"
        )
    for reason in summary["refusals"]:
        lines.append(f"refused: {reason}")
    return "\n".join(lines)


def run_demo(
    num_requests: int = 20,
    num_blocks: int = 200,
    preemption_mode: str = "recompute",
    admission: str = "predicted",
    arrival_rate: float | None = 0.5,
    seed: int = 0,
    figures: Path | None = FIGURES,
    progress: bool = True,
    model=None,
):
    """Serve the demo workload; returns (summary, engine). Writes figures unless figures is None."""

    model = model or load_default_model("threshold")
    workload = demo_workload(num_requests, arrival_rate, seed)
    # disable=None: no bar when stderr is not a terminal (CI logs, pipes), where each refresh would be a line
    bar = tqdm(
        total=len(workload), desc=f"admission {admission}", unit="req", disable=None if progress else True
    )

    def on_step(engine):
        bar.n = sum(r.is_finished for r in engine.requests.values())
        bar.set_postfix(
            step=engine.step_count,
            running=len(engine.scheduler.running),
            pool=f"{engine.memory.num_used_blocks}/{engine.memory.num_blocks}",
            refresh=False,
        )
        bar.refresh()

    engine, result = serve_workload(
        model, workload, num_blocks, preemption_mode=preemption_mode, admission=admission, on_step=on_step
    )
    bar.n = len(workload)
    bar.refresh()
    bar.close()
    engine.memory.assert_no_leak()
    summary = summarize(engine, result)
    if figures is not None:
        figures = Path(figures)
        figures.mkdir(parents=True, exist_ok=True)
        fig = plot_run(engine, demo_title(summary, num_blocks, admission, preemption_mode))
        path = figures / f"demo_serving_{admission}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")  # fixed margins: trim what they leave
        summary["figure"] = str(path)
    return summary, engine


def demo_title(summary: dict, num_blocks: int, admission: str, preemption_mode: str) -> str:
    """The figure's title: the requests that ran (a refused one never does, so it is counted apart)."""
    served = summary["requests"] - summary["refused"]
    refused = f" ({summary['refused']} refused)" if summary["refused"] else ""
    return (
        f"demo: {served} requests served{refused}, a pool of {num_blocks} blocks, "
        f"admission {admission}, preemption by {preemption_mode}"
    )


def build_parser(parser):
    parser.add_argument("--num-requests", type=int, default=20)
    parser.add_argument("--num-blocks", type=int, default=200, help="blocks in the pool (16 slots each)")
    parser.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    parser.add_argument(
        "--admission",
        choices=["both", "predicted", "optimistic"],
        default="both",
        help="admit on the predicted demand, on the next step only (vLLM's rule), or run both",
    )
    parser.add_argument("--arrival-rate", type=float, default=0.5, help="requests per engine step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figures", default=str(FIGURES), help="folder for the figures")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser


def main(args) -> int:
    matplotlib.use("Agg")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small shared machine: see bench_serving.run_serving_benchmark
    try:
        return _run(args)
    finally:
        torch.set_num_threads(previous_threads)


def check_args(args) -> None:
    """The demo's options, checked before anything runs. The pool must hold one token of one
    sequence (a block in each of its k_max experts of every layer); --preemption and --admission are
    choices argparse checks."""
    config = get_config("tiny").with_routing("threshold")
    least = config.num_hidden_layers * config.num_attention_experts_per_tok
    options.count("--num-requests", args.num_requests, 1)
    options.blocks(
        "--num-blocks",
        args.num_blocks,
        least,
        meaning=f"blocks of 16 slots; one token of one sequence takes {least}",
    )
    options.real("--arrival-rate", args.arrival_rate, 0, low_open=True, meaning="requests per engine step")
    options.seed("--seed", args.seed)
    options.folder("--figures", args.figures)


def _run(args) -> int:
    check_args(args)
    start = time.perf_counter()
    admissions = ["predicted", "optimistic"] if args.admission == "both" else [args.admission]
    summaries = {}
    for admission in admissions:
        summary, engine = run_demo(
            args.num_requests,
            args.num_blocks,
            args.preemption,
            admission,
            args.arrival_rate,
            args.seed,
            Path(args.figures),
            progress=not args.json,
        )
        summaries[admission] = summary
        if not args.json:
            print(f"\n== admission {admission}: " + ADMISSION_STORY[admission])
            print(format_summary(summary, engine))
            print(f"figure: {summary['figure']}")
    if args.json:
        print(json.dumps(summaries))
    else:
        print(f"\ntook {time.perf_counter() - start:.1f} s")
    return 0


ADMISSION_STORY = {
    "predicted": "admit while the predicted peak of the pool (routing statistics + tail bound) fits",
    "optimistic": "admit whenever the next step fits (vLLM's rule), preempt when the pool runs out",
}
