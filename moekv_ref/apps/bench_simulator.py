"""`python -m moekv_ref bench simulator [--against DIR] [--scale] [--json PATH]`: the simulator's own
speed, measured, not the cluster it simulates (that is `bench cluster`).

By default it times the trace runner (sim/runner.py: the engine's own Scheduler over a routing trace)
on two shapes (8 experts top-2 on 8 devices; 64 experts top-8 on 64), each run in a fresh process on
one thread. With `--against DIR` it times another checkout of this repository beside this one, in
turn, on the same traces, and checks that both made the same decisions: each run imports only its
own checkout's code (apps/checkout.py), and a checkout from before the runner's module was named
sim/runner.py (it was sim/eviction.py) is timed too.

`--scale [--requests N] [--threads T]` runs the second of those shapes at scale instead: N requests
(default 100,000) of a compact routing trace (sim/traces.py: a bank of routings, each token an index
into it), timing the trace, the runner's setup and the run, with a progress bar, and projecting 10^6
requests from the measured rate (linearly: stated as projected).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..jsonout import write
from ..sim.runner import RunnerSetup, TraceRunner
from ..sim.traces import synthetic_trace
from ..validation import MAX_COMPACT_TRACE_REQUESTS, MAX_TRACE_REQUESTS
from . import checkout, options
from .bench_step import REPOSITORY, commit_of

SPEED_REQUESTS = 1000  # the default of the speed run
SCALE_REQUESTS = 100_000  # the default of --scale
SCALE_ROUTINGS = 32_768  # distinct routings of --scale's compact trace (each token draws one)
SCALE_THREADS = 2  # the default of --threads: a two-core laptop


# ----- the simulator's own speed -----------------------------------------------------------------------------
# (layers, experts, top-k, devices, blocks per device): 8 experts top-2 on 8 devices, and DeepSeek-like
# granularity, 64 experts top-8 on 64; pools that let up to 256 sequences run at once
SPEED_SHAPES = ((24, 8, 2, 8, 80_000), (24, 64, 8, 64, 40_000))
# the workload of the speed run and --scale alike
SPEED_MEAN_PROMPT = 512
SPEED_MEAN_OUTPUT = 256
SPEED_MAX_NUM_SEQS = 256
SPEED_MAX_BATCHED_TOKENS = 8192

# Runs in a fresh process that imports moekv_ref from one checkout's root and nowhere else
# (apps/checkout.py says why that takes more than PYTHONPATH), using only what every version of the
# runner has had: a synthetic trace, TraceRunner(trace, placement, setup, policy, cost) with step costs
# off, run(). Its arguments: the root, a shape of SPEED_SHAPES, the requests and the workload.
SPEED_IMPORTS = [
    "import torch",
    "try:",
    "    from moekv_ref.sim.runner import RunnerSetup, TraceRunner",
    "except ModuleNotFoundError as missing:  # a checkout from before sim/eviction.py became sim/runner.py",
    "    if missing.name != 'moekv_ref.sim.runner':",
    "        raise",
    "    from moekv_ref.sim.eviction import EvictionSetup as RunnerSetup, TraceRunner",
    "from moekv_ref.sim.traces import synthetic_trace",
]
SPEED_WORKER = checkout.worker_code(
    SPEED_IMPORTS,
    """
import time
torch.set_num_threads(1)
L, E, K, D, blocks, n, mean_prompt, mean_output, max_num_seqs, max_batched = (int(x) for x in sys.argv[2:12])
trace = synthetic_trace(n, L, E, K, mean_prompt=mean_prompt, mean_output=mean_output, seed=0)
setup = RunnerSetup(blocks_per_device=blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched)
runner = TraceRunner(trace, torch.arange(E) % D, setup, "sequence_lru", None)
runner.step_seconds = lambda out: 0.0
started = time.perf_counter()
stats = runner.run()
wall = time.perf_counter() - started
print(json.dumps({"wall_seconds": wall, "steps": stats.num_steps, "max_running": int(stats.num_running.max()),
                  "evictions": stats.num_evictions, "blocks_in_use_summed": int(stats.used_blocks.sum())}))
""",
)
# the files of a checkout the worker imports by name (what they import is checked when it runs)
SPEED_WORKER_FILES = (
    ("moekv_ref/__init__.py",),
    ("moekv_ref/sim/runner.py", "moekv_ref/sim/eviction.py"),  # its name before, in older checkouts
    ("moekv_ref/sim/traces.py",),
)


def run_speed_worker(root: Path, arguments: list[str]) -> dict:
    """The last line SPEED_WORKER prints, as a dict, run on the checkout at root. ValueError when
    root is not a whole checkout: a module the worker needs is not there, or came from elsewhere."""
    command = checkout.worker_command(root, SPEED_WORKER, arguments)
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    error = checkout.refusal(root, lines[-1]) if lines else None
    if error is not None:
        raise error
    if done.returncode != 0:
        raise RuntimeError(f"the speed run at {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def check_speed_checkout(root: Path) -> list[str]:
    """The moekv_ref and moekv_kernels modules the speed worker loads at root, all of them from root
    (ValueError otherwise, before anything is timed)."""
    return checkout.check_checkout(root, SPEED_IMPORTS)


def speed_run(root: Path, shape: tuple, num_requests: int) -> dict:
    """One timed run of the trace runner of the checkout at `root` (module comment above)."""
    result = run_speed_worker(
        root,
        [
            *map(str, shape),
            str(num_requests),
            str(SPEED_MEAN_PROMPT),
            str(SPEED_MEAN_OUTPUT),
            str(SPEED_MAX_NUM_SEQS),
            str(SPEED_MAX_BATCHED_TOKENS),
        ],
    )
    return result | {
        "requests_per_second": num_requests / result["wall_seconds"],
        "steps_per_second": result["steps"] / result["wall_seconds"],
    }


def measure_speed(num_requests: int, against: Path | None) -> dict:
    """Both shapes, this checkout and `against` (if given) in turn, who goes first alternating: the
    same traces and decisions (the blocks in use, summed over steps, must agree), wall seconds. Each
    run imports only its own checkout's code; `against` is checked to be whole before anything runs."""
    roots = {"this": REPOSITORY} | ({"against": against.resolve()} if against is not None else {})
    if against is not None:
        check_speed_checkout(roots["against"])
    rows = []
    for i, shape in enumerate(tqdm(SPEED_SHAPES, desc="speed", unit="shape", disable=None)):
        order = list(roots) if i % 2 == 0 else list(roots)[::-1]
        runs = {name: speed_run(roots[name], shape, num_requests) for name in order}
        row = {
            "layers": shape[0],
            "experts": shape[1],
            "top_k": shape[2],
            "devices": shape[3],
            "blocks_per_device": shape[4],
            "requests": num_requests,
            "this": runs["this"],
        }
        if against is not None:
            if runs["against"]["blocks_in_use_summed"] != runs["this"]["blocks_in_use_summed"]:
                raise RuntimeError(f"the two checkouts made different decisions on shape {shape}")
            row["against"] = runs["against"]
            row["speedup"] = runs["against"]["wall_seconds"] / runs["this"]["wall_seconds"]
        rows.append(row)
    return {
        "shapes": rows,
        "this_commit": commit_of(REPOSITORY),
        "against_commit": commit_of(against) if against is not None else None,
        "threads": 1,
        "victim": "sequence_lru",
        "mean_prompt": SPEED_MEAN_PROMPT,
        "mean_output": SPEED_MEAN_OUTPUT,
    }


def measure_scale(num_requests: int, threads: int) -> dict:
    """The fine-grained speed shape (64 experts top-8 on 64 devices) at num_requests, in this process
    on `threads` threads: the same runner and Scheduler as the speed run, over a compact trace of
    SCALE_ROUTINGS distinct routings (a trace of every token's experts would not fit: 29 GB at
    10^5 requests). Seconds of each phase, and 10^6 requests projected from the measured rate."""
    torch.set_num_threads(threads)
    L, E, K, D, blocks = SPEED_SHAPES[1]
    started = time.perf_counter()
    trace = synthetic_trace(
        num_requests,
        L,
        E,
        K,
        mean_prompt=SPEED_MEAN_PROMPT,
        mean_output=SPEED_MEAN_OUTPUT,
        seed=0,
        distinct_routings=SCALE_ROUTINGS,
    )
    traced = time.perf_counter()
    setup = RunnerSetup(
        blocks_per_device=blocks,
        max_num_seqs=SPEED_MAX_NUM_SEQS,
        max_num_batched_tokens=SPEED_MAX_BATCHED_TOKENS,
    )
    runner = TraceRunner(trace, torch.arange(E) % D, setup, "sequence_lru", None)
    ready = time.perf_counter()
    with tqdm(total=num_requests, desc="scale", unit="request", disable=None) as bar:
        stats = runner.run(
            max_steps=100 * num_requests, on_step=lambda finished: bar.update(finished - bar.n)
        )
    done = time.perf_counter()
    total = done - started
    return {
        "layers": L,
        "experts": E,
        "top_k": K,
        "devices": D,
        "blocks_per_device": blocks,
        "requests": num_requests,
        "distinct_routings": SCALE_ROUTINGS,
        "threads": threads,
        "commit": commit_of(REPOSITORY),
        "trace_seconds": traced - started,
        "setup_seconds": ready - traced,
        "run_seconds": done - ready,
        "total_seconds": total,
        "steps": stats.num_steps,
        "finished": stats.num_finished,
        "refused": stats.num_refused,
        "max_running": int(stats.num_running.max()),
        "evictions": stats.num_evictions,
        "requests_per_second": num_requests / total,
        "steps_per_second": stats.num_steps / (done - ready),
        "projected_seconds_for_1e6": total * 1e6 / num_requests,
    }


def print_scale(result: dict) -> None:
    r = result
    print(
        f"\nthe trace runner at scale: {r['requests']:,} requests, {r['layers']} layers, {r['experts']} "
        f"experts top-{r['top_k']}, {r['devices']} devices, {r['threads']} thread(s)"
    )
    print(
        f"  trace {r['trace_seconds']:.1f} s, setup {r['setup_seconds']:.1f} s, run {r['run_seconds']:.1f} s: "
        f"{r['total_seconds'] / 60:.1f} min in all"
    )
    print(
        f"  {r['steps']:,} steps ({r['steps_per_second']:.1f} steps/s), {r['finished']:,} finished, "
        f"up to {r['max_running']} running, {r['evictions']} evictions: {r['requests_per_second']:.1f} requests/s"
    )
    print(f"  10^6 requests at this rate: {r['projected_seconds_for_1e6'] / 3600:.1f} h (projected, not run)")


def print_speed(result: dict) -> None:
    print(
        f"\nthe trace runner, {result['shapes'][0]['requests']} requests (mean prompt {result['mean_prompt']}, "
        f"output {result['mean_output']}), one thread:"
    )
    for row in result["shapes"]:
        shape = (
            f"{row['layers']} layers, {row['experts']} experts top-{row['top_k']}, {row['devices']} devices"
        )
        for name in ("against", "this"):
            if name in row:
                r = row[name]
                print(
                    f"  {shape:<44} {name:>7}: {r['wall_seconds']:6.1f} s  {r['requests_per_second']:6.1f} requests/s  "
                    f"{r['steps_per_second']:6.1f} steps/s  (up to {r['max_running']} running)"
                )
        if "speedup" in row:
            print(f"  {'':<44} {row['speedup']:.2f}x faster, the same decisions")


# ----- the program -------------------------------------------------------------------------------------------
def build_parser(parser=None):
    parser = parser or argparse.ArgumentParser(prog="python -m moekv_ref bench simulator")
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests of the workload (default {SPEED_REQUESTS}; with --scale {SCALE_REQUESTS:,})",
    )
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help="the root of another checkout of this repository to time beside this one",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help=f"run the 64-device shape at scale instead (--requests, default {SCALE_REQUESTS})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"with --scale: torch threads (default {SCALE_THREADS}, a two-core laptop)",
    )
    return parser


def check_args(args) -> None:
    options.output_file("--json", args.json, parents_made=True)
    if args.scale and args.against is not None:
        raise ValueError(
            "--against applies to the speed run (no --scale), not to --scale: it would be ignored; drop --against"
        )
    if not args.scale and args.threads is not None:
        raise ValueError(
            "--threads applies to --scale, not to the speed run (no --scale): it would be ignored; drop --threads"
        )
    options.count("--threads", args.threads, 1)
    options.input_folder("--against", args.against, "the root of a checkout of this repository")
    if args.against is not None and not (args.against / "moekv_ref" / "__init__.py").is_file():
        raise ValueError(
            f"--against={args.against} has no moekv_ref package; allowed: the root of a checkout"
        )
    missing = [
        names[0]
        for names in SPEED_WORKER_FILES
        if args.against and not any((args.against / name).is_file() for name in names)
    ]
    if missing:
        raise ValueError(
            f"--against={args.against} is not a complete checkout of this repository: it lacks "
            f"{', '.join(missing)}; allowed: the root of a checkout"
        )
    check_requests(args)


def check_requests(args) -> None:
    """--requests within the trace bounds of validation.py: the speed run builds a routing trace,
    --scale a compact one."""
    if args.scale:
        options.count(
            "--requests",
            args.requests,
            1,
            MAX_COMPACT_TRACE_REQUESTS,
            meaning="--scale's compact trace keeps 4 bytes a token",
        )
        return
    meaning = "a routing trace keeps every token's experts, about 0.2 MB a request"
    options.count("--requests", args.requests, 1, MAX_TRACE_REQUESTS, meaning=meaning)


def main(args) -> int:
    if args.scale:
        result = measure_scale(args.requests or SCALE_REQUESTS, args.threads or SCALE_THREADS)
        print_scale(result)
    else:
        result = measure_speed(args.requests or SPEED_REQUESTS, args.against)
        print_speed(result)
    if args.json:
        write(args.json, result, indent=1)  # strict JSON: no Infinity or NaN
        print(f"\nwrote {args.json}")
    return 0
