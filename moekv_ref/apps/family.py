"""`python -m moekv_ref train-family`: what does routing attention buy? A small family of models,
each a configuration of the one model code, trained the same way on the same bytes, then measured.

    dense               one attention expert of the same width (2 heads of 32): plain attention
    expert_topk         the embedded model's shape: 8 attention experts of 2 heads, top-2 per token
    expert_threshold    the same experts, threshold routing (p = 0.5, 1..2 experts per token)
    dense_kv_matched    dense attention caching as many bytes per token as expert_topk (4 heads of 32)
    dense_flops_matched dense attention with as many attention FLOPs per token as expert_topk at the
                        training context (2 heads of 56)

Every run uses the embedded model's recipe (apps/train.py: the CPython standard library's top-level
*.py files, AdamW, warm-up then cosine, the load-balancing loss on every router) with a *token*
budget instead of its 12 wall-clock minutes: `--steps` steps of `--batch-size` windows of `--context`
bytes, the same for every variant, with seeds 0, 1, 2 (the seed sets the initial weights and the
order of the training windows). The budget is smaller than the embedded model's so that the family
trains in about an hour on a laptop's CPU; its numbers describe models this small trained this
briefly, nothing more.

Measured per variant: held-out bits per byte (validation files never trained on, 32 fixed windows;
mean and spread over seeds), KV bytes per token (the config's worst case, and what the paged cache
actually held after prefilling held-out text), attention FLOPs per token at the training context,
parameters, and decode tokens/s of the paged cache on this machine (variants timed in alternating
rounds, medians). Writes figures/family.json, which notebook 09 reads.

Resumable: every run keeps its state in runs/family/ (every 50 steps) and its result once done, in
files named by variant, seed and budget; running the command again continues where it stopped.
`--fresh` starts over.
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

from ..config import ModelConfig, get_config
from ..generate import generate
from ..jsonout import dumps, source_commit
from ..model import MoEKVTransformer
from ..plots.tables import text_table
from ..sampling import SamplingParams
from ..stats import mean_ci95, mean_sd_text, paired_difference
from ..training import fit, random_windows
from . import options
from .train import load_corpus

DENSE = dict(attention_mode="dense", num_attention_experts=1, num_attention_experts_per_tok=1)
VARIANTS = {
    "dense": (DENSE, "dense attention, 2 heads of 32 (the width of one expert)"),
    "expert_topk": ({}, "8 attention experts, top-2 (the embedded model)"),
    "expert_threshold": (
        dict(attention_routing="threshold"),
        "8 attention experts, threshold p = 0.5, 1..2 per token",
    ),
    "dense_kv_matched": (
        {**DENSE, "num_attention_heads": 4, "num_key_value_heads": 4},
        "dense, 4 heads of 32: expert_topk's KV bytes per token",
    ),
    "dense_flops_matched": ({**DENSE, "head_dim": 56}, "dense, 2 heads of 56: expert_topk's attention FLOPs"),
}
SEEDS = (0, 1, 2)
OUT = Path("figures") / "family.json"
RUNS = Path("runs") / "family"


def variant_config(name: str, variants: dict = VARIANTS) -> ModelConfig:
    """The embedded model's configuration with a variant's fields (of this family, or `variants`)."""
    if name not in variants:
        raise ValueError(f"variant={name!r} is not one of {tuple(variants)}")
    return get_config("tiny", **variants[name][0])


def attention_flops_per_token(
    config: ModelConfig, context: int, experts_per_token: float | None = None
) -> float:
    """FLOPs (2 x multiply-adds) of one token's attention, all layers, for a token at the average
    position of a causal window of `context` tokens (it attends (context + 1) / 2 of them; an expert
    holds experts_per_token / E of those): the router, the q, k, v, o projections of every expert the
    token reaches, and the scores and weighted sum over what each expert holds. experts_per_token:
    measured mean (threshold routing); default k."""
    D, H, Hkv, Dh = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    E = config.num_attention_experts
    k = config.num_attention_experts_per_tok if experts_per_token is None else experts_per_token
    router = D * E if E > 1 else 0
    projections = k * (2 * D * H * Dh + 2 * D * Hkv * Dh)
    attended = (context + 1) / 2 * k / E
    scores = k * 2 * H * Dh * attended
    return 2 * config.num_hidden_layers * (router + projections + scores)


@torch.no_grad()
def heldout_bits_per_byte(model, valid_data: torch.Tensor, context: int, num_windows: int = 32) -> float:
    """Mean next-byte loss over fixed validation windows, in bits per byte."""
    x, y = random_windows(valid_data, num_windows, context, torch.Generator().manual_seed(1234))(0)
    losses = []
    for i in range(0, num_windows, 8):
        logits = model(x[i : i + 8]).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i : i + 8].reshape(-1)).item())
    return statistics.mean(losses) / math.log(2)


@torch.no_grad()
def cache_measurements(model, valid_data: torch.Tensor, context: int) -> dict:
    """Prefill 8 held-out windows into the paged cache and read what it holds: KV bytes per token
    (entries x bytes per entry / tokens) and entries per token per layer."""
    x, _ = random_windows(valid_data, 8, context, torch.Generator().manual_seed(99))(0)
    prompts = [row.tolist() for row in x]
    counts = generate(
        model, prompts, SamplingParams(max_new_tokens=1, temperature=0.0), cache="paged"
    ).cache_counts
    config = model.config
    tokens = sum(len(p) for p in prompts)
    entries = int(counts.sum())
    return {
        "kv_bytes_per_token": entries * config.kv_bytes_per_entry(4) / tokens,
        "experts_per_token": entries / tokens / config.num_hidden_layers,
    }


def decode_tokens_per_second(
    models: dict, rounds: int = 5, num_prompts: int = 8, new_tokens: int = 32
) -> dict:
    """Greedy decode through the paged cache, every variant once per round (alternating, so that a
    noisy machine slows all alike); the median over rounds of tokens / second."""
    prompts = [[(7 * i + j) % 200 + 32 for j in range(16)] for i in range(num_prompts)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    times = {name: [] for name in models}
    for name, model in models.items():  # warm up
        generate(model, prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0), cache="paged")
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            generate(model, prompts, params, cache="paged")
            times[name].append(time.perf_counter() - start)
    return {name: num_prompts * new_tokens / statistics.median(t) for name, t in times.items()}


def run_name(name: str, seed: int, steps: int, batch_size: int, context: int) -> str:
    """The files of one run in runs/family/ are named by variant, seed and budget."""
    return f"{name}-seed{seed}-{steps}x{batch_size}x{context}"


def train_run(
    name: str,
    seed: int,
    steps: int,
    batch_size: int,
    context: int,
    train_data,
    valid_data,
    runs: Path,
    bar=None,
    config: ModelConfig | None = None,
) -> dict:
    """One variant, one seed: trained (or resumed, or read back if done), measured. config: the
    variant's (default: this family's variant of that name)."""
    runs.mkdir(parents=True, exist_ok=True)
    done, state, weights = (
        runs / f"{run_name(name, seed, steps, batch_size, context)}{suffix}"
        for suffix in (".json", ".state.pt", ".pt")
    )
    if done.exists():
        if bar is not None:
            bar.update(steps)
        return json.loads(done.read_text())
    torch.manual_seed(seed)
    model = MoEKVTransformer(config if config is not None else variant_config(name))
    start = time.time()
    last = [0]

    def on_step(step, loss):
        if bar is not None:
            bar.update(step - last[0])
            bar.set_postfix(run=f"{name}/{seed}", loss=f"{loss:.2f}", refresh=False)
        last[0] = step

    generator = torch.Generator().manual_seed(seed)  # the data order, saved with the state
    fit(
        model,
        random_windows(train_data, batch_size, context, generator),
        num_steps=steps,
        generator=generator,
        state_path=state,
        on_step=on_step,
    )
    result = {
        "variant": name,
        "seed": seed,
        "budget": [steps, batch_size, context],
        "train_seconds": round(time.time() - start, 1),
        "bits_per_byte": heldout_bits_per_byte(model, valid_data, context),
    }
    torch.save(model.state_dict(), weights)
    state.unlink()
    done.write_text(dumps(result))
    return result


def train_runs(
    steps: int,
    batch_size: int,
    context: int,
    train_data,
    valid_data,
    runs: Path,
    variants,
    seeds,
    progress: bool = True,
    config_of=variant_config,
) -> list[dict]:
    """Every variant for every seed (config_of(name) its configuration), a whole family per seed so that
    a stopped run has all variants, under one progress bar; each run's result, in that order."""
    results = []
    with tqdm(
        total=steps * len(variants) * len(seeds),
        desc="train",
        unit="step",
        disable=None if progress else True,
    ) as bar:
        for seed in seeds:
            for name in variants:
                results.append(
                    train_run(
                        name,
                        seed,
                        steps,
                        batch_size,
                        context,
                        train_data,
                        valid_data,
                        runs,
                        bar,
                        config=config_of(name),
                    )
                )
    return results


def summarize(
    results: list[dict], measured: dict, speeds: dict, context: int, variants=tuple(VARIANTS)
) -> dict:
    """Per variant: bits per byte over seeds (mean, sample s.d., Student-t 95% interval, each seed's),
    KV bytes, FLOPs, parameters, decode tokens/s."""
    table = {}
    for name in variants:
        description = VARIANTS[name][1]
        config = variant_config(name)
        bpb = [r["bits_per_byte"] for r in results if r["variant"] == name]
        spread = mean_ci95(bpb)
        table[name] = {
            "description": description,
            "bits_per_byte_mean": spread["mean"],
            "bits_per_byte_sd": spread["sd"],
            "bits_per_byte_ci95": spread["ci95"],
            "bits_per_byte": bpb,
            "seeds": [r["seed"] for r in results if r["variant"] == name],
            "kv_bytes_per_token_config": config.kv_bytes_per_token,
            "kv_bytes_per_token_measured": measured[name]["kv_bytes_per_token"],
            "experts_per_token_measured": measured[name]["experts_per_token"],
            "attention_flops_per_token": attention_flops_per_token(
                config, context, measured[name]["experts_per_token"]
            ),
            "parameters": MoEKVTransformer(config).num_parameters(),
            "decode_tokens_per_second": speeds[name],
        }
    return table


def train_family(
    steps: int = 240,
    batch_size: int = 8,
    context: int = 128,
    out: Path = OUT,
    runs: Path = RUNS,
    variants=tuple(VARIANTS),
    seeds=SEEDS,
    progress: bool = True,
    speed_rounds: int = 5,
) -> dict:
    """Train (or resume) every variant for every seed, measure, write `out`; returns what it wrote."""
    torch.set_num_threads(1)
    train_data, valid_data = load_corpus()
    start = time.time()
    results = train_runs(steps, batch_size, context, train_data, valid_data, runs, variants, seeds, progress)
    models, measured = {}, {}
    for name in variants:
        model = MoEKVTransformer(variant_config(name))
        weights = runs / f"{run_name(name, seeds[0], steps, batch_size, context)}.pt"
        model.load_state_dict(torch.load(weights, weights_only=True))
        model.eval()
        models[name] = model
        measured[name] = cache_measurements(model, valid_data, context)
    speeds = decode_tokens_per_second(models, rounds=speed_rounds)
    family = {
        "budget": {
            "steps": steps,
            "batch_size": batch_size,
            "context": context,
            "tokens_per_run": steps * batch_size * context,
            "seeds": list(seeds),
        },
        "train_seconds_total": round(sum(r["train_seconds"] for r in results), 1),
        "wall_seconds_this_call": round(time.time() - start, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread, torch {torch.__version__}",
        "variants": summarize(results, measured, speeds, context, variants),
        "commit": source_commit(),  # this call's code (runs resumed from runs/ may be older)
        "runs": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(family, indent=1) + "\n")
    return family


def spread_of(row: dict) -> dict:
    """A table row's bits per byte over seeds (a variant's here, a setting's in apps/capacity.py) as
    stats.mean_ci95 names them."""
    return {
        "n": len(row["bits_per_byte"]),
        "mean": row["bits_per_byte_mean"],
        "sd": row["bits_per_byte_sd"],
        "ci95": row["bits_per_byte_ci95"],
    }


def differences(family: dict, base: str = "expert_topk") -> dict:
    """base's bits per byte minus each other variant's, paired by seed (the seeds share their data:
    stats.paired_difference), with the 95% interval of the paired t-test, n stated."""
    per_seed = {name: dict(zip(v["seeds"], v["bits_per_byte"])) for name, v in family["variants"].items()}
    return {name: paired_difference(per_seed[base], per_seed[name]) for name in per_seed if name != base}


def format_differences(family: dict, base: str = "expert_topk") -> str:
    """differences() as notebook 09 prints them (two decimals: what reproduces)."""
    lines = [f"{base} minus each variant, bits per byte, paired by seed: mean [95% interval]"]
    for name, d in differences(family, base).items():
        lines.append(
            f"  {name:<20} {d['mean']:+.2f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]  n = {d['n']}"
        )
    return "\n".join(lines)


def format_table(family: dict) -> str:
    """The variants as the notebook and the command print them (rounded to what reproduces)."""
    rows = [
        [
            name,
            mean_sd_text(spread_of(v)),
            v["kv_bytes_per_token_config"],
            round(v["kv_bytes_per_token_measured"]),
            f"{v['attention_flops_per_token'] / 1e3:.0f}k",
            f"{v['parameters'] / 1e6:.2f}M",
            int(round(v["decode_tokens_per_second"], -1)),  # tens: what reproduces, with no ".0"
        ]
        for name, v in family["variants"].items()
    ]
    n = len(family["budget"]["seeds"])
    return text_table(
        [
            "variant",
            f"bits/byte (mean ± s.d., {n} seeds)" if n > 1 else "bits/byte (1 seed)",
            "KV B/token (config)",
            "KV B/token (held)",
            "attn FLOPs/token",
            "params",
            "decode tok/s",
        ],
        rows,
    )


def build_parser(parser):
    parser.add_argument("--steps", type=int, default=240, help="optimizer steps per run (the token budget)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--fresh", action="store_true", help="forget runs/family/ and train every run again")
    return parser


def check_args(args) -> None:
    """The options, checked before anything trains."""
    options.count("--steps", args.steps, 1, meaning="optimizer steps per run")
    options.count("--batch-size", args.batch_size, 1, meaning="windows per step")
    options.count(
        "--context",
        args.context,
        2,
        get_config("tiny").max_position_embeddings,
        meaning="bytes per window, within the model's positions",
    )
    for seed in args.seeds:
        options.seed("--seeds", seed)
    options.distinct("--seeds", args.seeds, "the mean and spread over seeds count each seed once")
    options.distinct("--variants", args.variants, "each variant is trained and measured once")
    options.output_file("--out", args.out, parents_made=True)


def main(args) -> int:
    if args.fresh and RUNS.exists():
        for path in RUNS.iterdir():
            path.unlink()
    family = train_family(
        args.steps,
        args.batch_size,
        args.context,
        args.out,
        variants=tuple(args.variants),
        seeds=tuple(args.seeds),
    )
    print(format_table(family))
    print(f"training: {family['train_seconds_total'] / 60:.1f} min of runs; wrote {args.out}")
    return 0
