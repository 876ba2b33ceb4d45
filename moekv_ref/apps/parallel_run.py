"""`torchrun --nproc_per_node=N -m moekv_ref.apps.parallel_run [options]`: one run of the context sweep's model.

Every rank prefills one sequence of --context tokens per rank and decodes --decode-steps tokens under
the chosen KV placement and expert placement, then rank 0 prints the bytes per decode step (summed
over ranks), each rank's pool and the time split. torchrun's own options (--nnodes, --rdzv-endpoint,
...) run it across machines; NCCL is used when CUDA is available, gloo otherwise. Without torchrun
(no RANK in the environment) it starts --nproc ranks itself through the Python launcher.

Every option is checked before anything starts (exit code 2 and a message naming the option, its
value and what is allowed). --start-timeout bounds the wait for every rank to join, --timeout a
collective's wait for a peer (parallel/launcher.py). When a collective fails, the rank prints which ranks never
reached it (hung or dead), records that message for torchrun's summary, kills those of them that run
on its machine (a stopped one outlives torchrun's SIGTERM) and exits with code 1; torchrun then ends
the other ranks. Without torchrun the launcher does the same and the message is
printed as `error: ...` (exit code 1).

For tests only: MOEKV_FAULT=MODE@RANK:AT injects a fault (parallel/launcher.py: parse_fault): hang@1:2 makes rank 1
hang at the start of decode step 2, die@1:2 makes it exit, stop@1:2 stops it (SIGSTOP), slow_start@1:5
makes it join 5 s late.
(`bench parallel` honours slow_start only, and refuses the others.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from ..jsonout import dump
from ..parallel.comm import CollectiveError
from ..parallel.kv_placements import KV_PLACEMENTS
from ..parallel.launcher import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    FAULT_ENV,
    WorkerFailed,
    default_backend,
    join_group,
    kill_silent_peers,
    parse_fault,
)
from ..parallel.programs import run_parallel, run_specs
from ..placement import PLACEMENTS
from .parallel_measure import bytes_table, context_sweep_specs
from .parallel_options import (
    MAX_POSITIONS,
    WORLD_SIZES,
    one_of,
    positions_problems,
    seconds_problem,
    world_size_problem,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moekv_ref.apps.parallel_run", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--placement", choices=KV_PLACEMENTS, default="kv_with_expert", help="where the K/V lives"
    )
    parser.add_argument(
        "--expert-placement",
        choices=[p for p in PLACEMENTS if p != "coactivation"],
        default="round_robin",
        help="which rank holds which expert",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=256,
        help=f"prompt tokens per sequence (1 to {MAX_POSITIONS} minus --decode-steps)",
    )
    parser.add_argument(
        "--decode-steps", type=int, default=4, help="decode steps after the prefill (at least 1)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds a collective may wait on a peer before the run fails (default "
        f"{DEFAULT_TIMEOUT_S:g}: a hung rank is named and every rank gone within 30 s)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        help=f"seconds a rank may wait for every rank to join (default {DEFAULT_START_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help=f"ranks to start without torchrun ({one_of(WORLD_SIZES)}; torchrun decides its own)",
    )
    return parser


def parse(argv=None):
    """The options, checked: parser.error (exit code 2) names the first bad one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = world_size_problem(args.nproc)
    if problem:
        parser.error(f"--nproc {args.nproc}: {problem}")
    args.world_size = args.nproc
    if "RANK" in os.environ:  # under torchrun, which decides the world size
        args.world_size = int(os.environ.get("WORLD_SIZE", 1))
        problem = world_size_problem(args.world_size)
        if problem:
            parser.error(f"torchrun started WORLD_SIZE={args.world_size} ranks: {problem}")
    for problem in positions_problems([args.context], args.decode_steps):
        parser.error(problem)
    for option, value in (("--timeout", args.timeout), ("--start-timeout", args.start_timeout)):
        problem = seconds_problem(option, value)
        if problem:
            parser.error(problem)
    args.fault = None
    if os.environ.get(FAULT_ENV, "").strip():
        try:
            args.fault = parse_fault(os.environ[FAULT_ENV])
        except ValueError as error:
            parser.error(str(error))
        value = f"{FAULT_ENV}={os.environ[FAULT_ENV].strip()}"
        if args.fault.rank >= args.world_size:
            parser.error(
                f"{value}: rank {args.fault.rank} does not exist: the ranks are 0 to {args.world_size - 1}"
            )
        if args.fault.mode != "slow_start" and args.fault.at > args.decode_steps:
            parser.error(
                f"{value}: step {args.fault.at:.0f} never comes: the run has steps 0 (the prefill) to "
                f"{args.decode_steps} (--decode-steps {args.decode_steps})"
            )
    return args


def report(spec, results) -> None:
    row = bytes_table(spec, results)
    print(
        f"{row['kv_placement']}, context {row['context']}, {row['world_size']} ranks: "
        f"{row['bytes_per_decode_step']:.0f} bytes per decode step (attention {row['attention_bytes']:.0f}, "
        f"FFN {row['ffn_bytes']:.0f}, split sizes {row['split_size_bytes']:.0f}); "
        f"step {row['decode_step_ms']:.1f} ms of which {row['communication_ms']:.1f} ms in collectives"
    )
    for result in results:
        pool = result.pool[max(result.pool)]
        print(
            f"  rank {result.rank}: {pool['used_blocks']}/{pool['num_blocks']} blocks, {pool['tokens']} K/V tokens, "
            f"weights {result.weight_bytes['total']} bytes"
        )


def the_spec(args, world_size: int):
    spec = context_sweep_specs(
        world_size, (args.context,), (args.placement,), args.decode_steps, strategy=args.expert_placement
    )[0]
    if args.fault is not None and args.fault.mode != "slow_start":  # slow_start acts in join_group
        spec = dataclasses.replace(
            spec, fail_rank=args.fault.rank, fail_step=int(args.fault.at), fail_mode=args.fault.mode
        )
    return spec


def fail_rank(rank: int, error: BaseException, store=None) -> None:
    """Print why this rank fails, record it for torchrun's summary, end the ranks it waited for in
    vain if they run on this machine (a stopped rank outlives torchrun's SIGTERM by 30 s:
    launcher.kill_silent_peers), and exit now (code 1): the process group's teardown could wait on
    the very peer that hangs. store: the group's store, once joined."""
    if isinstance(error, CollectiveError):
        message = f"{type(error).__name__}: {error}"
    else:
        message = "".join(traceback.format_exception(error)).rstrip()
    print(f"[rank{rank}] error: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # what torchrun's "Root Cause" shows
    failed_at = int(time.time())
    if error_file:
        try:
            with open(error_file, "w") as handle:
                dump(
                    {
                        "message": {
                            "message": message,
                            "extraInfo": {"py_callstack": message, "timestamp": str(failed_at)},
                        }
                    },
                    handle,
                )
        except OSError:
            pass
    missing = error.missing if isinstance(error, CollectiveError) else ()
    if store is not None and missing:
        # torchrun's root cause is the failure of the earliest whole second, a tie going to the lower
        # rank: the ranks killed here must fail in a later second than this one, or one of them
        # (no message, only its signal) could be named instead
        while int(time.time()) <= failed_at:
            time.sleep(0.05)
        for peer, pid in kill_silent_peers(store, missing):
            print(
                f"[rank{rank}] killed rank {peer} (pid {pid}), silent on this machine: a stopped rank "
                f"would outlive torchrun's SIGTERM",
                file=sys.stderr,
                flush=True,
            )
    os._exit(1)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    if "RANK" not in os.environ:  # not under torchrun: start the ranks here
        spec = the_spec(args, args.nproc)
        try:
            results = run_parallel(
                [spec], args.nproc, timeout_s=args.timeout, start_timeout_s=args.start_timeout
            )
        except WorkerFailed as failure:
            print(f"error: {failure}", file=sys.stderr)
            return 1
        report(spec, results[0])
        return 0
    rank = int(os.environ["RANK"])
    context = None
    try:
        context = join_group(
            default_backend(),
            args.timeout,
            args.start_timeout,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )
        spec = the_spec(args, context.world_size)
        mine = run_specs(context, [spec])[0]
        everyone = [None] * context.world_size
        dist.all_gather_object(
            everyone, mine, group=context.comm.group
        )  # the report, after the measured steps
    except BaseException as error:  # noqa: BLE001 -- a failed rank says why and goes at once
        fail_rank(rank, error, None if context is None else context.comm.store)
    if context.rank == 0:
        report(spec, everyone)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
