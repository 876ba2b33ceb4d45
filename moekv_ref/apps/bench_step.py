"""`python -m moekv_ref bench step`: what one decode step of many sequences costs through the serving
engine on the embedded model, and, with `--against DIR`, the same steps on another checkout of this
repository (an older commit), measured side by side.

Side by side means interleaved: on a shared machine the load changes from second to second, so two
runs one after the other can differ by 1.5x for nothing. Here two worker processes, each with its own
model and engine (one imports this checkout, the other the checkout in DIR), take turns running one
engine step each on the same workload, so each pair of steps (this, that) sees the same load; who goes
first alternates. A step is timed in CPU time of its process (`time.process_time`), and the ratio
quoted is the median over pairs of decode steps (every sequence running, one token each).

With `--profile`, the same decode steps run in this process, for the embedded model and for a dense
model of its dimensions (one attention expert, random weights), and the time of each step is split
into phases (moekv_ref/profiling.py): the routers, the experts' projections, `append_kv`, `attend`,
the FFN experts, sampling, the scheduler (`schedule` and `update_from_output`, marked in the engine's
step), what the forward spends outside those (embedding, norms, residuals,
the LM head) and the rest of the step (batch flattening, undo snapshots, records): bookkeeping.

The worker uses only what every version of the engine has had: `load_default_model`, `LLMEngine(model,
num_blocks, block_size, SchedulerConfig(max_num_seqs=...))`, `add_request`, `step`, `timeline` (kept
with `record_history=True` where that option exists).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]  # the checkout this file belongs to


def prompts(num_seqs: int) -> list[list[int]]:
    """Distinct prompts of different lengths (20 + i bytes), so the rows fill their blocks unevenly."""
    return [
        list(f"def function_{i}(x, y):\n    return {i} * x + y".encode())[: 20 + i] for i in range(num_seqs)
    ]


def worker(num_seqs: int, max_new_tokens: int, num_blocks: int) -> None:
    """Serve step requests on stdin ("step" per line), answering one JSON line per step. Restarts the
    workload when it finishes. Runs in a process whose moekv_ref is one checkout's (`Worker`)."""
    import torch  # imported here: this function runs in a

    from moekv_ref.checkpoint import load_default_model  # process whose moekv_ref may be another
    from moekv_ref.engine import LLMEngine, SchedulerConfig  # checkout's (see the module docstring)
    from moekv_ref.sampling import SamplingParams

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_default_model()
    config = SchedulerConfig(max_num_seqs=num_seqs)
    try:  # the per-step timeline (which steps decode) is opt-in today; older engines always kept it
        engine = LLMEngine(
            model,
            num_blocks=num_blocks or NUM_BLOCKS,
            block_size=16,
            scheduler_config=config,
            record_history=True,
        )
    except TypeError:
        engine = LLMEngine(model, num_blocks=num_blocks or NUM_BLOCKS, block_size=16, scheduler_config=config)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        if not engine.has_unfinished_requests():
            for prompt in prompts(num_seqs):
                engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
        start = time.process_time()
        engine.step()
        seconds = time.process_time() - start
        record = engine.timeline[-1]
        decode = record.num_scheduled_tokens == num_seqs and record.num_running == num_seqs
        print(json.dumps({"cpu_s": seconds, "decode": decode}), flush=True)


# the worker's imports, checked to come from its checkout alone (apps/checkout.py says why)
WORKER_IMPORTS = [
    "import torch",
    "from moekv_ref.checkpoint import load_default_model",
    "from moekv_ref.engine import LLMEngine, SchedulerConfig",
    "from moekv_ref.sampling import SamplingParams",
]
# then this file, imported by its path as a module outside both checkouts, runs `worker`
WORKER_BODY = f"""
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import bench_step
bench_step.worker(*(int(a) for a in sys.argv[2:5]))
"""


class Worker:
    """A worker process whose `moekv_ref` is the checkout at `root`, and no other's."""

    def __init__(self, root: Path, num_seqs: int, max_new_tokens: int, num_blocks: int):
        from . import checkout  # here: the worker imports this file outside the package

        code = checkout.worker_code(WORKER_IMPORTS, WORKER_BODY)
        command = checkout.worker_command(root, code, [str(num_seqs), str(max_new_tokens), str(num_blocks)])
        self.root = root
        self.process = subprocess.Popen(
            command,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def step(self) -> dict:
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        from . import checkout

        line = self.process.stdout.readline()
        error = checkout.refusal(self.root, line)
        if error is not None:
            raise error
        if not line:
            raise RuntimeError(f"the worker for {self.root} stopped (exit code {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def commit_of(root: Path) -> str | None:
    """The git commit checked out at root (None outside a git checkout)."""
    try:
        return (
            subprocess.run(
                ["git", "-C", str(root), "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def measure(
    against: Path | None,
    num_seqs: int = 16,
    max_new_tokens: int = 48,
    num_rounds: int = 3,
    num_blocks: int = 4096,
) -> dict:
    """Interleave this checkout's steps with `against`'s (if given) for `num_rounds` whole workloads."""
    roots = {"this": REPOSITORY} | ({"against": against.resolve()} if against is not None else {})
    if against is not None:
        from . import checkout

        checkout.check_checkout(roots["against"], WORKER_IMPORTS)
    workers = {name: Worker(root, num_seqs, max_new_tokens, num_blocks) for name, root in roots.items()}
    decode = {name: [] for name in workers}
    try:  # a round is one prefill step and max_new_tokens - 1 decode steps; workers restart by themselves
        for pair in range(num_rounds * max_new_tokens):
            order = list(workers) if pair % 2 == 0 else list(reversed(workers))
            results = {name: workers[name].step() for name in order}
            if all(r["decode"] for r in results.values()):
                for name, r in results.items():
                    decode[name].append(r["cpu_s"])
    finally:
        for w in workers.values():
            w.close()
    if not decode["this"]:
        raise ValueError(
            f"no step decoded all {num_seqs} sequences at once: give max_new_tokens >= 2 "
            f"(got {max_new_tokens})"
        )
    result = {
        "num_seqs": num_seqs,
        "max_new_tokens": max_new_tokens,
        "num_decode_pairs": len(decode["this"]),
        "this_commit": commit_of(REPOSITORY),
        "this_decode_step_cpu_ms": 1000 * statistics.median(decode["this"]),
    }
    if against is not None:
        ratios = sorted(a / t for a, t in zip(decode["against"], decode["this"]))
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        result |= {
            "against_commit": commit_of(against),
            "against_decode_step_cpu_ms": 1000 * statistics.median(decode["against"]),
            "speedup_median": statistics.median(ratios),
            "speedup_quartiles": [quartiles[0], quartiles[2]],
        }
    return result


MODEL_PHASES = ("routing", "projections", "append_kv", "attend", "ffn")
PHASE_NAMES = {
    "routing": "routing (both routers, sort by expert)",
    "projections": "projections (QKV, rotary, O)",
    "append_kv": "append_kv",
    "attend": "attend",
    "ffn": "FFN dispatch (experts, combine)",
    "rest_of_forward": "rest of forward (embed, norms, head)",
    "sampling": "sampling",
    "scheduler": "scheduler",
    "bookkeeping": "bookkeeping (rest of the step)",
}


def profile_steps(
    model, num_seqs: int, max_new_tokens: int, num_rounds: int, num_blocks: int | None = None
) -> dict:
    """ms per decode step of each phase (see the module docstring), averaged over the decode steps
    (all num_seqs sequences running) of num_rounds workloads, in this process."""
    import torch

    from moekv_ref.engine import LLMEngine, SchedulerConfig
    from moekv_ref.profiling import collect
    from moekv_ref.sampling import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(
        model,
        num_blocks=num_blocks or NUM_BLOCKS,
        block_size=16,
        scheduler_config=SchedulerConfig(max_num_seqs=num_seqs),
        record_history=True,
    )
    totals, num_steps = {}, 0
    for round_index in range(num_rounds + 1):  # round 0 warms up
        for prompt in prompts(num_seqs):
            engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
        while engine.has_unfinished_requests():
            with collect() as times:
                start = time.process_time()
                engine.step()
                times["step"] = time.process_time() - start
            record = engine.timeline[-1]
            if round_index > 0 and record.num_scheduled_tokens == num_seqs and record.num_running == num_seqs:
                num_steps += 1
                for name, seconds in times.items():
                    totals[name] = totals.get(name, 0.0) + seconds
    ms = {name: 1000 * seconds / num_steps for name, seconds in totals.items()}
    phases = {name: ms.get(name, 0.0) for name in MODEL_PHASES}
    phases["rest_of_forward"] = ms["forward"] - sum(phases.values())
    phases["sampling"] = ms.get("sampling", 0.0)
    phases["scheduler"] = ms.get("scheduler", 0.0)
    phases["bookkeeping"] = ms["step"] - ms["forward"] - phases["sampling"] - phases["scheduler"]
    return {"num_decode_steps": num_steps, "step_ms": ms["step"], "phases_ms": phases}


def profile(num_seqs: int, max_new_tokens: int, num_rounds: int) -> dict:
    """profile_steps for the embedded model and for the dense model of its dimensions."""
    from moekv_ref.apps.bench_peer import random_dense_model
    from moekv_ref.checkpoint import load_default_model

    return {
        "num_seqs": num_seqs,
        "max_new_tokens": max_new_tokens,
        "this_commit": commit_of(REPOSITORY),
        "dense": profile_steps(random_dense_model(seed=0), num_seqs, max_new_tokens, num_rounds),
        "embedded": profile_steps(load_default_model(), num_seqs, max_new_tokens, num_rounds),
    }


def format_profile(result: dict) -> str:
    models = ("dense", "embedded")
    lines = [
        f"one decode step of {result['num_seqs']} sequences by phase, CPU ms per step (mean over "
        f"{result['dense']['num_decode_steps']} and {result['embedded']['num_decode_steps']} steps), "
        "one thread",
        f"  {'phase':<40}" + "".join(f"{m:>10} {'share':>6}" for m in models),
    ]
    for name, label in PHASE_NAMES.items():
        cells = ""
        for m in models:
            value, step = result[m]["phases_ms"][name], result[m]["step_ms"]
            cells += f"{value:>10.2f} {100 * value / step:>5.0f}%"
        lines.append(f"  {label:<40}{cells}")
    lines.append(f"  {'step':<40}" + "".join(f"{result[m]['step_ms']:>10.2f} {100:>5.0f}%" for m in models))
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help="root of another checkout (e.g. `git worktree add /tmp/old <commit>`) to compare with",
    )
    parser.add_argument("--num-seqs", type=int, default=16, help="sequences decoding at once (default 16)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=48, help="tokens each sequence decodes (default 48)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="times the whole workload runs (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="split a decode step into phases, for the embedded and a dense model (this checkout)",
    )
    return parser


MAX_POSITIONS = 512  # the embedded model's max_position_embeddings (the tiny preset)
BLOCKS_PER_TOKEN = 8  # one token of one sequence: a block in each of k = 2 experts of 4 layers
NUM_BLOCKS = 4096  # the workers' pool (measure's default)


def check_args(args) -> None:
    """The options, checked before a worker starts. A round needs a decode step after the prefill
    (--max-new-tokens >= 2), and the longest prompt plus its new tokens must fit the model's positions."""
    from moekv_ref.apps import options  # here, not at the top: a worker may run another checkout

    options.input_folder("--against", args.against, "the root of a checkout of this repository")
    if args.against is not None and not (args.against / "moekv_ref" / "__init__.py").is_file():
        raise ValueError(
            f"--against={args.against} has no moekv_ref package; allowed: the root of a checkout "
            "of this repository (e.g. `git worktree add /tmp/old <commit>`)"
        )
    options.count(
        "--num-seqs",
        args.num_seqs,
        1,
        NUM_BLOCKS // BLOCKS_PER_TOKEN,
        f"all decode at once in a pool of {NUM_BLOCKS} blocks, each taking at least {BLOCKS_PER_TOKEN}",
    )
    options.count("--rounds", args.rounds, 1)
    if getattr(args, "profile", False) and args.against is not None:
        raise ValueError("--profile runs this checkout only; drop --against")
    options.output_file("--json", args.json, parents_made=True)
    longest = max(len(p) for p in prompts(args.num_seqs))
    options.count(
        "--max-new-tokens",
        args.max_new_tokens,
        2,
        MAX_POSITIONS - longest + 1,
        f"a prefill, then decode steps; the longest prompt has {longest} tokens of {MAX_POSITIONS} positions",
    )


def strict_json(result: dict) -> str:
    """The result as strict JSON (moekv_ref/jsonout.py), imported here: this file also runs as a
    worker script, outside the package, where a relative import at the top would fail."""
    from moekv_ref.jsonout import dumps

    return dumps(result, indent=2) + "\n"


def write_json(path, result: dict) -> None:
    """strict_json(result) written to path, its missing folders made (moekv_ref/paths.py)."""
    from moekv_ref.paths import output_path

    output_path(path).write_text(strict_json(result))


def main(args) -> int:
    check_args(args)
    if args.profile:
        result = profile(args.num_seqs, args.max_new_tokens, args.rounds)
        print(format_profile(result))
        if args.json is not None:
            write_json(args.json, result)
        return 0
    try:
        result = measure(args.against, args.num_seqs, args.max_new_tokens, args.rounds)
    except ValueError as error:
        raise SystemExit(f"bench step: {error}") from None
    print(
        f"decode step of {result['num_seqs']} sequences, CPU ms (median of {result['num_decode_pairs']} steps)"
    )
    print(
        f"  this checkout    {result['this_decode_step_cpu_ms']:8.1f}   {REPOSITORY} ({result['this_commit']})"
    )
    if args.against is not None:
        low, high = result["speedup_quartiles"]
        print(
            f"  --against        {result['against_decode_step_cpu_ms']:8.1f}   "
            f"{args.against} ({result['against_commit']})"
        )
        print(
            f"  speedup (median of per-pair ratios): {result['speedup_median']:.2f}x "
            f"(quartiles {low:.2f}-{high:.2f})"
        )
    if args.json is not None:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    from moekv_ref.apps.options import parse_checked

    main(
        parse_checked(
            build_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0])), check=check_args
        )
    )
