"""`python -m moekv_ref capacity`: what a per-row KV budget costs in quality, dense and routed.

Four configurations of the one model code, trained alike (training.py's loop, the same token
budget, seeds 0, 1, 2) at a context of 512 bytes, the model's limit, so that budgets bind:

    dense                 one attention expert, 2 heads of 32: plain attention
    expert_topk           8 attention experts of 2 heads, top-2 (the embedded model's shape)
    expert_topk_capacity  the same, trained with a capacity of 128 tokens per (sequence, expert)
                          (Switch's capacity factor 1: 512 tokens x 2 / 8 experts); tokens over it
                          are dropped, in training and in the cache alike (routing.apply_capacity)
    expert_choice         8 experts, each choosing the 128 best-scored tokens of a training window
                          (Mixture of Sparse Attention, arXiv 2505.00315); decoding cannot look
                          ahead, so its cache keeps the best so far (router_score)

Each trained model is then measured on the same held-out windows of 512 bytes (validation files
never trained on) with no budget and under every policy of cache/budget.py at B = 100%, 50%, 25%
and 12.5% of its mean row (512 tokens for dense attention, 512 x 2 / 8 = 128 for the routed
variants), through the budgeted recompute (`model(x, budget=...)`, which the tests hold equal to the
paged cache). Per measurement: bits per byte, and the KV bytes per token the rows actually hold at the
end of the window (entries, and whole blocks of 16 as a paged pool holds them), and attention FLOPs
per token (the projections of every pair a budget accepted, and scores over the keys each query saw).
expert_choice without a budget is its training rule, which looks ahead: the gap between it and
router_score at B = 128 is the price of decoding causally.

Resumable: training state and every finished run live in runs/capacity/, named like train-family's;
running the command again continues where it stopped. Writes figures/capacity.json and
figures/capacity_frontier.png (`python -m moekv_ref figures` redraws the PNG from the JSON).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..cache.budget import BUDGET_POLICIES, RowBudget, model_budget
from ..config import ModelConfig
from ..jsonout import dumps, source_commit
from ..model import MoEKVTransformer
from ..plots.capacity import frontier_rows, plot_capacity
from ..plots.tables import text_table
from ..stats import mean_ci95, mean_sd_text, paired_difference, sign_of
from ..training import random_windows
from . import family, options
from .family import run_name
from .train import load_corpus

CONTEXT = 512
CAPACITY = 128  # 512 tokens x 2 experts / 8 experts: top-2's mean row
DENSE = dict(attention_mode="dense", num_attention_experts=1, num_attention_experts_per_tok=1)
VARIANTS = {
    "dense": (DENSE, "dense attention, 2 heads of 32"),
    "expert_topk": ({}, "8 attention experts, top-2"),
    "expert_topk_capacity": (
        dict(attention_capacity=CAPACITY),
        "8 experts, top-2, trained with a capacity of 128",
    ),
    "expert_choice": (
        dict(attention_routing="expert_choice", num_attention_experts_per_tok=8, attention_capacity=CAPACITY),
        "8 experts, each choosing 128 tokens of a window",
    ),
}
FRACTIONS = (1.0, 0.5, 0.25, 0.125)  # of the mean row
SEEDS = (0, 1, 2)
BLOCK_SIZE = 16
NUM_WINDOWS = 16
OUT = Path("figures") / "capacity.json"
RUNS = Path("runs") / "capacity"


def variant_config(name: str) -> ModelConfig:
    return family.variant_config(name, VARIANTS)


def mean_row(config: ModelConfig, context: int = CONTEXT) -> int:
    """Tokens an average row holds after a window: context x k / E (every token under dense attention)."""
    if config.attention_routing == "expert_choice":
        return config.attention_capacity
    return context * config.num_attention_experts_per_tok // config.num_attention_experts


def settings(config: ModelConfig) -> list[tuple[str, int | None, float | None]]:
    """(policy, B, fraction of the mean row) measured for one variant: no budget, then every policy
    the model can have at every fraction."""
    policies = [p for p in BUDGET_POLICIES if not (p == "router_score" and config.num_attention_experts == 1)]
    return [("none", None, None)] + [
        (policy, max(1, round(f * mean_row(config))), f) for policy in policies for f in FRACTIONS
    ]


def heldout_windows(valid_data: torch.Tensor, num_windows: int = NUM_WINDOWS, context: int = CONTEXT):
    """(x, y) fixed held-out windows, the same for every model."""
    return random_windows(valid_data, num_windows, context, torch.Generator().manual_seed(1234))(0)


def attention_flops(config: ModelConfig, accepted: torch.Tensor, budget_tokens: int | None) -> float:
    """FLOPs (2 x multiply-adds) of attention per token, one layer's accepted (B, T, E) pairs: the
    router, the q, k, v, o projections of every accepted pair, and scores plus weighted sum over the
    keys its row held when it attended (its earlier accepted tokens and itself, at most B)."""
    D, H, Hkv, Dh = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    E = config.num_attention_experts
    seen = torch.cumsum(accepted.long(), dim=1)  # (B, T, E) row size then
    if budget_tokens is not None:
        seen = seen.clamp(max=budget_tokens)
    keys = (seen * accepted).sum().item()  # over every query
    pairs = accepted.sum().item()
    tokens = accepted.shape[0] * accepted.shape[1]
    router = D * E if E > 1 else 0
    return 2 * (router * tokens + pairs * (2 * D * H * Dh + 2 * D * Hkv * Dh) + keys * 2 * H * Dh) / tokens


@torch.no_grad()
def measure(model: MoEKVTransformer, x: torch.Tensor, y: torch.Tensor, budget: RowBudget | None) -> dict:
    """Bits per byte over the windows, and what the rows hold at their end, per token of a window."""
    config = model.config
    output = model(x, budget=budget)
    loss = F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), y.reshape(-1)).item()
    entries = 0.0
    slots = 0.0
    flops = 0.0
    for layer, routing in enumerate(output.attention_routing):  # accepted pairs
        limit = None if budget is None else budget.limit_of_layer(layer)
        held = routing.selected.sum(1)  # (B, E) accepted
        if limit is not None:
            held = held.clamp(max=limit)
        entries += held.sum().item()
        slots += (-(-held // BLOCK_SIZE) * BLOCK_SIZE).sum().item()
        flops += attention_flops(config, routing.selected, limit)
    tokens = x.numel()
    per_entry = config.kv_bytes_per_entry(4)
    return {
        "bits_per_byte": loss / math.log(2),
        "kv_bytes_per_token": entries * per_entry / tokens,
        "pool_bytes_per_token": slots * per_entry / tokens,
        "attention_flops_per_token": flops,
    }


def measure_run(name: str, seed: int, steps: int, batch_size: int, runs: Path, x, y, bar=None) -> list[dict]:
    """Every setting of one trained run, read back if already measured."""
    stem = runs / run_name(name, seed, steps, batch_size, CONTEXT)
    done = Path(f"{stem}.measured.json")
    config = variant_config(name)
    if done.exists():
        rows = json.loads(done.read_text())
    else:
        model = MoEKVTransformer(config)
        model.load_state_dict(torch.load(f"{stem}.pt", weights_only=True))
        model.eval()
        rows = []
        for policy, tokens, fraction in settings(config):
            start = time.time()
            budget = None if policy == "none" else RowBudget(tokens, policy)
            rows.append(
                {
                    "variant": name,
                    "seed": seed,
                    "policy": policy,
                    "budget_tokens": tokens,
                    "fraction": fraction,
                    **measure(model, x, y, budget),
                    "seconds": round(time.time() - start, 1),
                }
            )
            if bar is not None:
                bar.update(1)
        done.write_text(dumps(rows))
        return rows
    if bar is not None:
        bar.update(len(rows))
    return rows


def summarize(rows: list[dict], variants) -> list[dict]:
    """One row per (variant, policy, budget): bits per byte over seeds (mean, sample s.d., Student-t
    95% interval, and each seed's), and the means of the costs."""
    table = []
    for name in variants:
        for policy, tokens, fraction in settings(variant_config(name)):
            runs = [
                r for r in rows if (r["variant"], r["policy"], r["budget_tokens"]) == (name, policy, tokens)
            ]
            bpb = [r["bits_per_byte"] for r in runs]
            spread = mean_ci95(bpb)
            table.append(
                {
                    "variant": name,
                    "policy": policy,
                    "budget_tokens": tokens,
                    "fraction": fraction,
                    "bits_per_byte_mean": spread["mean"],
                    "bits_per_byte_sd": spread["sd"],
                    "bits_per_byte_ci95": spread["ci95"],
                    "bits_per_byte": bpb,
                    "seeds": [r["seed"] for r in runs],
                    **{
                        key: statistics.mean(r[key] for r in runs)
                        for key in ("kv_bytes_per_token", "pool_bytes_per_token", "attention_flops_per_token")
                    },
                }
            )
    return table


def train_inference_gaps(rows: list[dict], variants) -> dict:
    """For each variant trained with a capacity: bits per byte under the budget its caches decode with
    (budget.model_budget: drop, or router_score for expert choice) minus under its training rule (no
    budget), per seed, with their mean, sample s.d. and Student-t 95% interval (paired by seed: the
    gap is told apart from zero when the interval leaves it out), n stated. Token choice's drop is
    causal, so its gap is 0."""
    gaps = {}
    for name in variants:
        budget = model_budget(variant_config(name))
        if budget is None:
            continue
        per_seed = {
            r["seed"]: r["bits_per_byte"] for r in rows if r["variant"] == name and r["policy"] == "none"
        }
        causal = {
            r["seed"]: r["bits_per_byte"]
            for r in rows
            if r["variant"] == name
            and (r["policy"], r["budget_tokens"]) == (budget.policy, budget.max_tokens)
        }
        gap = paired_difference(causal, per_seed)
        gaps[name] = {
            "decoding_policy": budget.policy,
            "budget_tokens": budget.max_tokens,
            "gap": [causal[s] - per_seed[s] for s in sorted(per_seed)],
            "gap_mean": gap["mean"],
            "gap_sd": gap["sd"],
            "gap_ci95": gap["ci95"],
            "n": gap["n"],
            "told_apart_from_zero": sign_of(gap) != 0,
        }
    return gaps


def against_dense(table: list[dict], variants) -> list[dict]:
    """Each routed variant's frontier point beside the best dense setting holding no more KV bytes per
    token: the difference in bits per byte, paired by seed (the seeds share their data), with its
    Student-t 95% interval, and a verdict from that paired t-test: "beats" when the interval lies
    below zero, "loses" above, else "ties"."""
    dense = [r for r in table if r["variant"] == "dense"]
    rows = []
    for name in variants:
        if name == "dense" or not dense:
            continue
        for point in frontier_rows(table, name):
            rival = min(
                (r for r in dense if r["kv_bytes_per_token"] <= point["kv_bytes_per_token"] + 1e-9),
                key=lambda r: r["bits_per_byte_mean"],
                default=None,
            )
            if rival is None:
                continue
            difference = paired_difference(
                dict(zip(point["seeds"], point["bits_per_byte"])),
                dict(zip(rival["seeds"], rival["bits_per_byte"])),
            )
            verdict = {-1: "beats", 0: "ties", 1: "loses"}[sign_of(difference)]
            rows.append(
                {
                    "variant": name,
                    "policy": point["policy"],
                    "budget_tokens": point["budget_tokens"],
                    "kv_bytes_per_token": point["kv_bytes_per_token"],
                    "bits_per_byte": point["bits_per_byte_mean"],
                    "dense_policy": rival["policy"],
                    "dense_budget_tokens": rival["budget_tokens"],
                    "dense_kv_bytes_per_token": rival["kv_bytes_per_token"],
                    "dense_bits_per_byte": rival["bits_per_byte_mean"],
                    "difference": difference["mean"],
                    "difference_ci95": difference["ci95"],
                    "n": difference["n"],
                    "verdict": verdict,
                }
            )
    return rows


def summaries(rows: list[dict], variants) -> dict:
    """What the study reports, all from its runs: the table, the train-inference gaps, the frontier
    points against dense attention, the frontiers."""
    table = summarize(rows, variants)
    return {
        "table": table,
        "train_inference_gap": train_inference_gaps(rows, variants),
        "against_dense": against_dense(table, variants),
        "frontier": {
            name: [(r["policy"], r["budget_tokens"]) for r in frontier_rows(table, name)] for name in variants
        },
    }


def capacity_study(
    steps: int = 200,
    batch_size: int = 4,
    out: Path = OUT,
    runs: Path = RUNS,
    variants=tuple(VARIANTS),
    seeds=SEEDS,
    progress: bool = True,
) -> dict:
    """Train (or resume) every variant for every seed, measure every setting, write `out`."""
    torch.set_num_threads(1)
    train_data, valid_data = load_corpus()
    start = time.time()
    trained = family.train_runs(
        steps, batch_size, CONTEXT, train_data, valid_data, runs, variants, seeds, progress, variant_config
    )
    x, y = heldout_windows(valid_data)
    total = sum(len(settings(variant_config(name))) for name in variants) * len(seeds)
    rows = []
    with tqdm(total=total, desc="measure", unit="setting", disable=None if progress else True) as bar:
        for seed in seeds:
            for name in variants:
                rows.extend(measure_run(name, seed, steps, batch_size, runs, x, y, bar))
    study = {
        "budget": {
            "steps": steps,
            "batch_size": batch_size,
            "context": CONTEXT,
            "tokens_per_run": steps * batch_size * CONTEXT,
            "seeds": list(seeds),
            "heldout_windows": NUM_WINDOWS,
            "block_size": BLOCK_SIZE,
            "fractions": list(FRACTIONS),
        },
        "variants": {name: VARIANTS[name][1] for name in variants},
        "train_seconds_total": round(sum(r["train_seconds"] for r in trained), 1),
        "measure_seconds_total": round(sum(r["seconds"] for r in rows), 1),
        "wall_seconds_this_call": round(time.time() - start, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread, torch {torch.__version__}",
        **summaries(rows, variants),
        "commit": source_commit(),  # this call's code (runs resumed from runs/ may be older)
        "runs": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(study, indent=1) + "\n")
    return study


def format_table(study: dict) -> str:
    """The table as the command and the notebook print it (rounded to what reproduces)."""
    rows = [
        [
            r["variant"],
            r["policy"],
            "-" if r["budget_tokens"] is None else r["budget_tokens"],
            "-" if r["fraction"] is None else f"{r['fraction']:g}",
            mean_sd_text(family.spread_of(r)),
            round(r["kv_bytes_per_token"]),
            round(r["pool_bytes_per_token"]),
            f"{r['attention_flops_per_token'] / 1e3:.0f}k",
        ]
        for r in study["table"]
    ]
    n = len(study["budget"]["seeds"])
    return text_table(
        [
            "variant",
            "policy",
            "B",
            "of mean row",
            f"bits/byte (mean ± s.d., {n} seeds)",
            "KV B/token held",
            "pool B/token",
            "attn FLOPs/token",
        ],
        rows,
    )


def readme_table(study: dict) -> str:
    """docs/results.md's table: per variant and policy, bits per byte (mean ± sample s.d. over seeds)
    with no budget and at each fraction of the mean row, each with the KV bytes per token held there."""
    fractions = study["budget"]["fractions"]
    header = (
        "| variant | policy | no budget | "
        + " | ".join(f"B = {f * 100:g}% of the mean row" for f in fractions)
        + " |"
    )
    lines = [header, "|" + " --- |" * (3 + len(fractions))]

    def cell(r):
        return f"{mean_sd_text(family.spread_of(r))} ({round(r['kv_bytes_per_token'])} B)"

    for name in study["variants"]:
        none = next(r for r in study["table"] if r["variant"] == name and r["policy"] == "none")
        for policy in dict.fromkeys(
            r["policy"] for r in study["table"] if r["variant"] == name and r["policy"] != "none"
        ):
            mine = {r["fraction"]: r for r in study["table"] if (r["variant"], r["policy"]) == (name, policy)}
            lines.append(
                f"| {name} | {policy} | {cell(none)} | " + " | ".join(cell(mine[f]) for f in fractions) + " |"
            )
    return "\n".join(lines)


def build_parser(parser):
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (the token budget)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows of 512 bytes per step")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--out", type=Path, default=OUT)
    return parser


def check_args(args) -> None:
    options.count("--steps", args.steps, 1, meaning="optimizer steps per run")
    options.count("--batch-size", args.batch_size, 1, meaning="windows per step")
    for seed in args.seeds:
        options.seed("--seeds", seed)
    options.distinct("--seeds", args.seeds, "the mean and spread over seeds count each seed once")
    options.distinct("--variants", args.variants, "each variant is trained and measured once")
    options.output_file("--out", args.out, parents_made=True)
    options.output_file("--out's figure", figure_path(args.out), parents_made=True)


def figure_path(out: Path) -> Path:
    """The frontier figure, written beside the study's JSON."""
    return out.with_name("capacity_frontier.png")


def main(args) -> int:
    study = capacity_study(
        args.steps, args.batch_size, args.out, variants=tuple(args.variants), seeds=tuple(args.seeds)
    )
    figure = figure_path(args.out)
    plot_capacity(study).savefig(figure, dpi=110)
    print(format_table(study))
    print(
        f"training: {study['train_seconds_total'] / 60:.1f} min of runs, measuring "
        f"{study['measure_seconds_total'] / 60:.1f} min; wrote {args.out} and {figure}"
    )
    return 0
