"""Command line: `python -m moekv_ref COMMAND ...`

generate       generate from a prompt with the embedded model and report its per-expert caches
routing-stats  what the embedded model's routers learned (load, entropy, character preferences)
demo           serve a stream of requests through a small pool: continuous batching, preemption
bench          benchmarks: `bench memory`, `bench serving`, `bench eviction`, `bench parallel`, `bench step`,
               `bench peer`, `bench cluster`, `bench simulator` (the simulator's own speed),
               `bench reservation` (reservation strategies in steady state)
train-family   train dense and expert-attention variants the same way and measure them (about an hour)
capacity       train variants at 512 bytes and measure what per-row KV budgets cost in quality
figures        regenerate every PNG in figures/ from the package
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys

import torch

from ..analysis import format_routing_statistics, heldout_text, routing_statistics
from ..backends import BackendUnavailableError
from ..checkpoint import COMPUTE_DTYPES, DEFAULT_CHECKPOINT, load_checkpoint
from ..config import TOKEN_CHOICE_ROUTINGS, get_config
from ..engine import generate_with_engine
from ..generate import CACHE_KINDS, generate
from ..prompts import check_prompt, decode, encode
from ..report import cache_report, format_cache_report
from ..sampling import MIN_TEMPERATURE, SamplingParams
from . import (
    bench_cluster,
    bench_eviction,
    bench_memory,
    bench_parallel,
    bench_peer,
    bench_reservation,
    bench_serving,
    bench_simulator,
    bench_step,
    capacity,
    demo,
    family,
    figures,
    options,
)

# Sampling defaults of `generate`, chosen by looking at samples of the embedded model (validation loss
# 1.63 nats per byte) for six prompts, five seeds each, at (temperature, top_p) = (0.7, 0.8), (0.8,
# 0.95), (0.9, 0.9) and (1.0, 0.9): below temperature 1 the model falls into runs of dozens of spaces
# (indentation is its most likely byte) in 10 to 21 of the 30 samples; at 1.0 with top_p 0.9 in 6,
# and its text keeps Python's shape (calls, `self.`, indented lines).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.9
# torch threads of `generate`: one decode step of the tiny model is small work, and an intra-op thread
# that waits for a core another process holds stalls every step. 64 tokens (the whole command) on a
# two-core machine under a load of 5: 3.9-6.4 s on one thread, 7.2-37.5 s on two (torch's default
# there: a thread a core).
GENERATE_THREADS = 1
INTERPRETER_NOTICE = (
    "note: --backend triton without a GPU runs the kernels in Triton's CPU interpreter "
    "(TRITON_INTERPRET=1), much slower than --backend torch: minutes for 64 tokens, not seconds"
)


def _check_model_options(args) -> None:
    """Options of every model command, checked before anything is loaded."""
    if args.threshold is not None and args.routing != "threshold":
        raise ValueError(f"--threshold applies to --routing threshold, not --routing {args.routing}")
    options.real(
        "--threshold",
        args.threshold,
        0,
        1,
        low_open=True,
        meaning="a probability mass: the router keeps experts up to it",
    )


def check_generate(args) -> None:
    """Every option of `generate`, before the model is loaded."""
    _check_model_options(args)
    if args.backend != "torch" and args.cache != "paged":
        raise ValueError(f"--backend {args.backend} runs on the paged cache: add --cache paged")
    if args.block_size is not None and args.cache != "paged":
        raise ValueError(f"--block-size applies to --cache paged, not --cache {args.cache}")
    options.block_size("--block-size", args.block_size)
    if args.greedy and args.temperature is not None:
        raise ValueError("--greedy and --temperature contradict each other: greedy is --temperature 0")
    options.real("--temperature", args.temperature, 0, meaning="0: greedy")
    if args.temperature is not None and 0 < args.temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"--temperature={args.temperature} is too small to sample with; allowed: 0 (greedy) "
            f"or at least {MIN_TEMPERATURE}"
        )
    options.real(
        "--top-p", args.top_p, 0, 1, low_open=True, meaning="nucleus sampling: the probability mass kept"
    )
    options.seed("--seed", args.seed)
    options.count("--threads", args.threads, 1, meaning="torch threads while generating")
    limit = get_config("tiny").max_position_embeddings
    options.count("--max-new-tokens", args.max_new_tokens, 1, limit)
    options.utf8_text("--prompt", args.prompt)
    prompt = encode(args.prompt)
    if not prompt:
        raise ValueError("--prompt='' is empty; allowed: at least one character")
    try:
        check_prompt(prompt, 256, limit, args.max_new_tokens)
    except ValueError as error:
        raise ValueError(
            f"--prompt of {len(prompt)} bytes with --max-new-tokens={args.max_new_tokens}: {error}"
        ) from None


def check_routing_stats(args) -> None:
    _check_model_options(args)
    options.count("--max-tokens", args.max_tokens, 1, meaning="tokens of held-out text to route")


def _load_model(args, backend: str = "torch"):
    config = get_config("tiny").with_routing(args.routing, args.threshold)
    return load_checkpoint(args.checkpoint, config, COMPUTE_DTYPES[args.dtype], backend)


def cmd_generate(args) -> int:
    check_generate(args)  # cli.main has checked already; again for a caller of cmd_generate
    temperature = (
        0.0 if args.greedy else (DEFAULT_TEMPERATURE if args.temperature is None else args.temperature)
    )
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=args.top_p, seed=args.seed
    )
    prompt = encode(args.prompt)
    model = _load_model(args, args.backend)
    if args.backend == "triton":
        # the load imported moekv_kernels, which sets TRITON_INTERPRET=1 where no GPU is visible
        from moekv_kernels._utils import is_interpreting

        if is_interpreting():
            print(INTERPRETER_NOTICE, file=sys.stderr, flush=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _generate_and_report(args, model, prompt, params)
    finally:
        torch.set_num_threads(previous_threads)


def _generate_and_report(args, model, prompt: list[int], params: SamplingParams) -> int:
    """cmd_generate's work once the model is loaded: stream (or collect) the tokens, then report."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens

    def stream(_, token):
        sys.stdout.write(decoder.decode(bytes([token])))
        sys.stdout.flush()

    if not args.json:
        sys.stdout.write(args.prompt)

    on_token = None if args.json else stream
    if args.cache == "paged":  # served by the continuous-batching engine, as a server would
        engine_options = {} if args.block_size is None else {"block_size": args.block_size}
        result = generate_with_engine(model, [prompt], params, on_token=on_token, **engine_options)
    else:
        result = generate(model, [prompt], params, cache=args.cache, on_token=on_token)
    bytes_per_value = torch.finfo(COMPUTE_DTYPES[args.dtype]).bits // 8
    report = cache_report(result.cache_counts, model.config, bytes_per_value)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt": args.prompt,
                    "tokens": result.tokens[0],
                    "text": decode(result.tokens[0]),
                    "cache_kind": args.cache,
                    "backend": args.backend,
                    "routing": args.routing,
                    "cache": report,
                }
            )
        )
    else:
        print("\n")
        print(format_cache_report(report))
    return 0


def cmd_routing_stats(args) -> int:
    check_routing_stats(args)
    model = _load_model(args)
    stats = routing_statistics(model, heldout_text(), max_tokens=args.max_tokens)
    print(json.dumps(stats) if args.json else format_routing_statistics(stats))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moekv_ref", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def model_options(p):
        p.add_argument(
            "--routing", choices=TOKEN_CHOICE_ROUTINGS, default="topk", help="attention routing rule"
        )
        p.add_argument(
            "--threshold",
            type=float,
            default=None,
            help="probability mass for --routing threshold (default: the preset's, 0.35 for tiny)",
        )
        p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
        p.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="float32")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    g = sub.add_parser("generate", help="generate text and report the per-expert caches")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--cache", choices=CACHE_KINDS, default="contiguous")
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per block for --cache paged (a power of two; default 16)",
    )
    g.add_argument(
        "--backend",
        choices=["torch", "triton"],
        default="torch",
        help="decode attention in PyTorch or in the Triton kernels (on a CPU: the interpreter; "
        "Linux only, where triton has wheels)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--threads",
        type=int,
        default=GENERATE_THREADS,
        help=f"torch threads while generating (default {GENERATE_THREADS}: on a small or busy machine more "
        "threads wait for cores and slow every step)",
    )
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"sampling temperature (default {DEFAULT_TEMPERATURE})",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=DEFAULT_TOP_P,
        help=f"nucleus sampling: keep the most probable tokens up to this mass (default {DEFAULT_TOP_P})",
    )
    model_options(g)
    g.set_defaults(func=cmd_generate, check=check_generate, command_parser=g)

    r = sub.add_parser("routing-stats", help="what the embedded model's routers learned")
    r.add_argument("--max-tokens", type=int, default=20000)
    model_options(r)
    r.set_defaults(func=cmd_routing_stats, check=check_routing_stats, command_parser=r)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    benchmarks = [
        ("memory", bench_memory, bench_memory.run_bench_memory, "memory designs on the same workloads"),
        ("eviction", bench_eviction, bench_eviction.main, "victim policies under per-device pools"),
        ("serving", bench_serving, bench_serving.main, "static vs continuous batching, one budget"),
        ("parallel", bench_parallel, bench_parallel.main, "expert parallelism: bytes per step, placements"),
        (
            "step",
            bench_step,
            bench_step.main,
            "one decode step's CPU time, optionally against another checkout",
        ),
        ("peer", bench_peer, bench_peer.main, "dense decode against Hugging Face Mixtral, same weights"),
        (
            "cluster",
            bench_cluster,
            bench_cluster.main,
            "victim policies on a cluster: latency, goodput, SLOs",
        ),
        (
            "simulator",
            bench_simulator,
            bench_simulator.main,
            "the simulator's own speed: beside another checkout, or at scale",
        ),
        (
            "reservation",
            bench_reservation,
            bench_reservation.main,
            "reservation strategies in steady state: goodput against the clairvoyant bound",
        ),
    ]
    for name, module, run, help_text in benchmarks:
        b = module.build_parser(bench.add_parser(name, help=help_text))
        b.set_defaults(func=run, check=getattr(module, "check_args", None), command_parser=b)
    d = demo.build_parser(sub.add_parser("demo", help="serve requests through a small pool (the main demo)"))
    d.set_defaults(func=demo.main, check=demo.check_args, command_parser=d)
    t = family.build_parser(
        sub.add_parser("train-family", help="train dense and expert-attention variants, measure them")
    )
    t.set_defaults(func=family.main, check=family.check_args, command_parser=t)
    c = capacity.build_parser(
        sub.add_parser("capacity", help="train variants at 512 bytes, measure KV budgets' quality")
    )
    c.set_defaults(func=capacity.main, check=capacity.check_args, command_parser=c)
    f = figures.build_parser(sub.add_parser("figures", help="regenerate every PNG in figures/"))
    f.set_defaults(func=figures.main, check=figures.check_args, command_parser=f)
    return parser


def main(argv=None) -> int:
    """Run one command. A bad option is parser.error (usage, `error: ...`, exit status 2) before the
    command starts; an error while it runs (a missing checkpoint, every request refused) prints
    `error: ...` and returns 2."""
    args = build_parser().parse_args(options.signed_values(argv))
    options.fail_on(args.command_parser, args.check, args)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError, BackendUnavailableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
