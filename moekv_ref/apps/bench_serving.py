"""`python -m moekv_ref bench serving`: one workload, one memory budget, three serving designs.

    static               fixed batches: a batch starts when the previous one has finished, every
                         member decodes until the batch's longest output is done (padding), and each
                         reserves, for every (layer, expert) row, room for the padded length
    continuous_reserved  iteration-level batching (requests join and leave at every step), but each
                         request still reserves every row's worst case for its whole life
    continuous_paged     this engine: the paged pool, admission on a prediction of routed demand,
                         the worst case of one step reserved, preemption when the pool runs short

All three are the same LLMEngine with a different SchedulerConfig.policy: the same ModelRunner, the
same PagedKVCache storage of `num_blocks` blocks, the same model and sampling. What differs is only
how many sequences each design's memory accounting lets run at once, and the steps static batching
wastes on padding -- which is what the benchmark is meant to measure. (Static prefills are ragged here,
not padded: that only favours `static`.)

tokens_per_second counts the tokens requests asked for (padding excluded) over the wall time of the
engine's steps. The three designs run one after another in one process, in the same order every time.

With `--budget B`, the two continuous designs run again with a row budget (cache/budget.py): every
(sequence, layer, expert) row holds at most B tokens, so a request's largest cache is bounded whatever
its length or routing, and the reserved design's lifetime reservation shrinks to that exact bound.
A budget changes what the model sees (the policy evicts or refuses), so those rows' tokens are
compared among themselves, not with the exact cache's; what it costs the model is measured beside
them (`budget_quality`): held-out bits per byte with the exact cache and under the budget, on 16
windows of validation files (never trained on) of 128 bytes, the embedded model's training windows,
and of 512.
mean_used_fraction: the pool's blocks in use after each step, averaged over steps.
"""

from __future__ import annotations

import torch

from ..cache.budget import BUDGET_POLICIES, RowBudget
from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from ..config import get_config
from ..engine import LLMEngine, SchedulerConfig
from ..engine.workload import make_workload, run_workload
from ..jsonout import dump, source_commit
from ..model import MoEKVTransformer
from ..paths import output_path
from ..validation import MAX_INT32, MAX_SERVING_REQUESTS
from . import options
from .capacity import NUM_WINDOWS, heldout_windows, measure
from .train import load_corpus

DESIGNS = ("static", "continuous_reserved", "continuous_paged")


def serve_design(
    model: MoEKVTransformer,
    workload,
    design: str,
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    preemption_mode: str = "recompute",
    budget: RowBudget | None = None,
) -> dict:
    """Serve `workload` with one design (under a row budget, if given); returns its row of the table."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=design,
        preemption_mode=preemption_mode,
    )
    engine = LLMEngine(model, num_blocks, block_size, config, budget=budget)
    used = []
    result = run_workload(engine, workload, on_step=lambda e: used.append(e.memory.num_used_blocks))
    stats = engine.stats()
    engine.memory.assert_no_leak()
    served = bool(result.outputs) and stats.seconds > 0
    return {
        "tokens_per_second": stats.num_generated_tokens / stats.seconds if served else None,
        "first_refusal": next(iter(result.refused.values()), None),
        "max_concurrent_sequences": stats.max_concurrent_sequences,
        "preemptions": stats.num_preemptions,
        "recomputed_tokens": stats.num_recomputed_tokens,
        "steps": stats.num_steps,
        "generated_tokens": stats.num_generated_tokens,
        "seconds": stats.seconds,
        "peak_used_blocks": stats.peak_used_blocks,
        "mean_concurrent_sequences": stats.mean_concurrent_sequences,
        "mean_used_fraction": sum(used) / len(used) / num_blocks if used else 0.0,
        "refused": len(result.refused),
        "tokens": {i: out.token_ids for i, out in result.outputs.items()},
    }


def run_serving_benchmark(
    model: MoEKVTransformer,
    num_requests: int = 32,
    num_blocks: int = 1024,
    block_size: int = 16,
    prompt_len=(8, 256),
    output_len=(8, 192),
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    seed: int = 0,
    designs=DESIGNS,
    num_threads: int | None = 1,
    budget: RowBudget | None = None,
) -> dict:
    """Every design on the same workload and memory budget, in one run. Also checks that the
    designs generate the same tokens (they must: sampling is per request, seeded).

    num_threads: torch intra-op threads during the run (None: leave as is). One by default: on a
    small shared machine, intra-op threads that wait for a core taken by another process slow the
    designs with larger batches far more than the others, and the benchmark would measure that
    contention instead of scheduling and memory. budget: also run the continuous designs under it,
    as rows named "<design> + budget"."""
    workload = make_workload(
        num_requests, prompt_len, output_len, seed=seed, vocab_size=model.config.vocab_size
    )
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        rows = {
            d: serve_design(model, workload, d, num_blocks, block_size, max_num_seqs, max_num_batched_tokens)
            for d in designs
        }
        budgeted = [d for d in designs if d != "static"] if budget is not None else []
        for d in budgeted:
            rows[f"{d} + budget"] = serve_design(
                model,
                workload,
                d,
                num_blocks,
                block_size,
                max_num_seqs,
                max_num_batched_tokens,
                budget=budget,
            )
    finally:
        torch.set_num_threads(previous_threads)
    token_sets = [rows[d].pop("tokens") for d in designs]
    budget_token_sets = [rows[f"{d} + budget"].pop("tokens") for d in budgeted]
    for design, row in rows.items():
        if row["tokens_per_second"] is None:
            raise ValueError(
                f"every request was refused under {design}: {row.pop('first_refusal')} -- give "
                f"more blocks than {num_blocks} or shorter requests"
            )
        row.pop("first_refusal")
    same = all(t == token_sets[0] for t in token_sets[1:])
    kv_bytes = (
        2
        * num_blocks
        * block_size
        * model.config.num_key_value_heads
        * model.config.head_dim
        * next(model.parameters()).element_size()
    )
    report = {
        "workload": {
            "num_requests": num_requests,
            "prompt_len": list(prompt_len),
            "output_len": list(output_len),
            "routing": model.config.attention_routing,
            "seed": seed,
        },
        "memory_budget": {"num_blocks": num_blocks, "block_size": block_size, "kv_bytes": kv_bytes},
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "num_threads": num_threads,
        "designs": rows,
        "same_tokens_in_every_design": same,
    }
    if budget is not None:
        report["budget"] = {
            "max_tokens": budget.max_tokens,
            "policy": budget.policy,
            "num_sinks": budget.num_sinks,
        }
        report["same_tokens_in_every_budgeted_design"] = all(
            t == budget_token_sets[0] for t in budget_token_sets[1:]
        )
    if "static" in rows and "continuous_paged" in rows:
        report["speedup_paged_vs_static"] = (
            rows["continuous_paged"]["tokens_per_second"] / rows["static"]["tokens_per_second"]
        )
    if "continuous_reserved" in rows and "continuous_paged" in rows:
        report["speedup_paged_vs_reserved"] = (
            rows["continuous_paged"]["tokens_per_second"] / rows["continuous_reserved"]["tokens_per_second"]
        )
    return report


# windows of 128 bytes, the embedded model's training windows (its checkpoint's metadata), and of
# 512, the capacity study's and the longest the model takes, longer than it was trained on
QUALITY_CONTEXTS = (128, 512)


def budget_quality(model: MoEKVTransformer, budget: RowBudget, num_windows: int = NUM_WINDOWS) -> dict:
    """What the budget costs the model beside what it buys in tokens/s: held-out bits per byte
    with the exact cache and under the budget (capacity.measure: the budgeted recompute, which the
    tests hold equal to the paged cache), on held-out windows of each QUALITY_CONTEXTS length."""
    _, valid_data = load_corpus()
    rows = {}
    for context in QUALITY_CONTEXTS:
        x, y = heldout_windows(valid_data, num_windows, context)
        with torch.no_grad():
            exact = measure(model, x, y, None)["bits_per_byte"]
            budgeted = measure(model, x, y, budget)["bits_per_byte"]
        rows[str(context)] = {
            "windows": int(x.shape[0]),
            "bits_per_byte_exact": exact,
            "bits_per_byte_budget": budgeted,
            "cost_bits_per_byte": budgeted - exact,
        }
    return rows


def format_serving_report(report: dict) -> str:
    budget = report["memory_budget"]
    lines = [
        f"workload: {report['workload']['num_requests']} requests, prompts {report['workload']['prompt_len']}, "
        f"outputs {report['workload']['output_len']} tokens, {report['workload']['routing']} routing",
        f"memory budget: {budget['num_blocks']} blocks of {budget['block_size']} slots "
        f"({budget['kv_bytes'] / 2**20:.1f} MiB of K/V), same for every design",
        "",
        f"{'design':<31}{'tokens/s':>10}{'max seqs':>10}{'mean seqs':>11}{'steps':>8}{'preempt':>9}"
        f"{'recomputed':>12}{'pool used':>11}",
    ]
    for design, row in report["designs"].items():
        lines.append(
            f"{design:<31}{row['tokens_per_second']:>10.1f}{row['max_concurrent_sequences']:>10}"
            f"{row['mean_concurrent_sequences']:>11.1f}{row['steps']:>8}{row['preemptions']:>9}"
            f"{row['recomputed_tokens']:>12}{row['mean_used_fraction']:>11.2f}"
        )
    if "speedup_paged_vs_static" in report:
        lines.append(f"\nspeedup continuous_paged vs static: {report['speedup_paged_vs_static']:.2f}x")
    if "speedup_paged_vs_reserved" in report:
        lines.append(
            f"speedup continuous_paged vs continuous_reserved: {report['speedup_paged_vs_reserved']:.2f}x"
        )
    lines.append(f"same tokens in every design: {report['same_tokens_in_every_design']}")
    if "budget" in report:
        b = report["budget"]
        lines.append(
            f"budget: at most {b['max_tokens']} tokens per (sequence, layer, expert) row, policy {b['policy']}; "
            f"same tokens in every budgeted design: {report['same_tokens_in_every_budgeted_design']}"
        )
    for context, q in report.get("quality", {}).items():
        lines.append(
            f"what the budget costs the model on {q['windows']} held-out windows of {context} bytes: "
            f"{q['bits_per_byte_budget']:.3f} bits per byte against {q['bits_per_byte_exact']:.3f} with "
            f"the exact cache ({q['cost_bits_per_byte']:+.3f})"
        )
    return "\n".join(lines)


QUICK = dict(num_requests=8, prompt_len=(8, 64), output_len=(8, 32), num_blocks=512)


def build_parser(parser):
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"requests in the workload (default 32, at most {MAX_SERVING_REQUESTS})",
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="the memory budget every design gets (default 1024)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--routing", choices=["threshold", "topk"], default="threshold")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--quick", action="store_true", help="a small workload (for tests and a first look)")
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="also run the continuous designs with at most this many tokens per row",
    )
    parser.add_argument(
        "--budget-policy",
        choices=BUDGET_POLICIES,
        default=None,
        help="what a full row does (with --budget; default window)",
    )
    return parser


def check_args(args) -> None:
    """The options, checked before anything runs. --num-blocks must hold one token of one sequence
    (a block in each of its k_max experts of every layer); --routing is a choice argparse checks,
    --checkpoint the loader's (it names a missing file)."""
    if args.quick and (args.num_requests is not None or args.num_blocks is not None):
        raise ValueError("--quick sets its own --num-requests and --num-blocks: give either --quick or those")
    config = get_config("tiny").with_routing(args.routing)
    least = config.num_hidden_layers * config.num_attention_experts_per_tok
    options.count(
        "--num-requests",
        args.num_requests,
        1,
        MAX_SERVING_REQUESTS,
        meaning=f"{MAX_SERVING_REQUESTS} take about an hour to serve on a CPU",
    )
    options.blocks(
        "--num-blocks", args.num_blocks, least, meaning=f"one token of one sequence takes {least} blocks"
    )
    options.block_size("--block-size", args.block_size)
    options.seed("--seed", args.seed)
    options.count("--budget", args.budget, 1, MAX_INT32, meaning="tokens per (sequence, layer, expert) row")
    if args.budget_policy is not None and args.budget is None:
        raise ValueError(
            f"--budget-policy {args.budget_policy} applies to --budget, which is not given: add --budget B"
        )
    options.output_file("--json", args.json, parents_made=True)


def main(args) -> int:
    """Entry point of `python -m moekv_ref bench serving`."""
    check_args(args)
    sizes = (
        dict(QUICK)
        if args.quick
        else dict(
            num_requests=32 if args.num_requests is None else args.num_requests,
            num_blocks=1024 if args.num_blocks is None else args.num_blocks,
        )
    )
    model = load_checkpoint(args.checkpoint, get_config("tiny").with_routing(args.routing))
    policy = "window" if args.budget_policy is None else args.budget_policy
    budget = None if args.budget is None else RowBudget(args.budget, policy)
    report = run_serving_benchmark(model, block_size=args.block_size, seed=args.seed, budget=budget, **sizes)
    if budget is not None:
        report["quality"] = budget_quality(model, budget)
    report["commit"] = source_commit()  # the code that ran (-dirty: with uncommitted changes)
    print(format_serving_report(report))
    if args.json:
        with open(output_path(args.json), "w") as handle:
            dump(report, handle, indent=2)
        print(f"wrote {args.json}")
    return 0
