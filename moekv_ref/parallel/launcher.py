"""Start N ranks from Python (a test, a notebook, a benchmark) and collect what each returns.

    results = launch(module_level_function, world_size=4, args=(spec,))

Each rank is a new process (see `launch`), so the function must be importable by name. A rank
runs in the caller's environment of the moment, joins the group through `join_group` (gloo on CPU,
NCCL with CUDA) and returns function(context, *args) to the parent. The rendezvous store lives in
the parent, so a rank whose collective failed can still read how far its peers got (comm.py).

Two timeouts, as starting and waiting differ: `start_timeout_s` (120 s) for every rank to join
(spawning and importing torch is slow on a loaded machine), and `timeout_s` (15 s) for a collective
to wait for a peer, instead of the 30-minute default: the longest healthy wait seen on this CPU is
about a second (`bench parallel`, 4 ranks, context 2048).

When a rank fails, the parent gives the others `grace_s` (3 s) to report, kills the rest (a hung
rank never returns) and raises WorkerFailed, naming first the ranks that kept a peer waiting: every
rank is gone timeout_s + grace_s = 18 s after a hang. Under torchrun (apps/parallel_run.py) the
waiting rank exits, so it is torchrun's "Root Cause", and torchrun ends the others within its 0.1 s
monitor interval: about timeout_s + 1 s. tests/test_parallel_failure.py measures both.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import pickle
import queue as queue_module
import re
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..validation import MAX_INT32, check_int
from .comm import CollectiveError, Communicator, first_line, name_ranks

FAULT_KEY = "moekv/fault_at"  # where an injected fault notes its wall-clock time
FAULT_ENV = "MOEKV_FAULT"  # test-only fault injection: see Fault
FAULT_MODES = ("die", "hang", "slow_start")
DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_TIMEOUT_S = 15.0  # a collective's wait for a peer
DEFAULT_GRACE_S = 3.0
MAX_TIMEOUT_S = 86400.0  # a day: beyond it a timeout is no longer a limit (and timedelta overflows)


class WorkerFailed(RuntimeError):
    """Ranks failed (the message: module docstring). missing: the ranks a peer waited for in vain;
    ended_at: wall-clock time every rank was gone; fault_at: an injected fault's time, or None."""

    def __init__(self, message: str, ended_at: float, fault_at: float | None, missing: tuple = ()):
        super().__init__(message)
        self.ended_at, self.fault_at, self.missing = ended_at, fault_at, tuple(missing)


@dataclass
class WorkerContext:
    """What a worker function receives."""

    rank: int
    world_size: int
    comm: Communicator
    device: torch.device


@dataclass(frozen=True)
class Fault:
    """MOEKV_FAULT=MODE@RANK:AT: "die" or "hang" at the start of decode step AT (0: the prefill;
    RunSpec.fail_*, applied by apps/parallel_run.py), or "slow_start": join AT seconds late."""

    mode: str
    rank: int
    at: float


def parse_fault(text: str) -> Fault:
    match = re.fullmatch(r"(\w+)@(\d+):(\d+(?:\.\d*)?)", text.strip())
    if not match or match.group(1) not in FAULT_MODES:
        raise ValueError(
            f"{FAULT_ENV}={text!r} must be MODE@RANK:AT with MODE one of {FAULT_MODES}: "
            f"e.g. hang@1:2 (rank 1 hangs at decode step 2) or slow_start@1:5 (joins 5 s late)"
        )
    mode, rank, at = match.group(1), int(match.group(2)), float(match.group(3))
    if mode != "slow_start" and not at.is_integer():
        raise ValueError(f"{FAULT_ENV}={text!r}: the step of {mode!r} must be an integer")
    return Fault(mode, rank, at)


def fault_from_environment() -> Fault | None:
    text = os.environ.get(FAULT_ENV, "")
    return parse_fault(text) if text.strip() else None


def check_seconds(name: str, value) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT_S
    ):
        raise ValueError(f"{name}={value!r} must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f}")
    return float(value)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def join_group(
    backend: str,
    timeout_s: float,
    start_timeout_s: float,
    store=None,
    rank: int = -1,
    world_size: int = -1,
    local_rank: int = 0,
) -> WorkerContext:
    """Join the process group, waiting up to start_timeout_s for every rank, then make the group the
    collectives run on, whose timeout is timeout_s. store=None: torchrun's environment (env://)."""
    fault = fault_from_environment()
    if (
        fault is not None
        and fault.mode == "slow_start"
        and fault.rank == (rank if store is not None else int(os.environ.get("RANK", 0)))
    ):
        time.sleep(fault.at)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    start = datetime.timedelta(seconds=start_timeout_s)
    if store is None:
        dist.init_process_group(backend, timeout=start)
        try:
            progress = dist.distributed_c10d._get_default_store()  # progress keys for naming a failed rank
        except Exception:  # noqa: BLE001 -- without it, errors name only the collective
            progress = None
    else:
        store.set(f"moekv/joined/{rank}", "1")
        began = time.monotonic()
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("process_group", store),
                rank=rank,
                world_size=world_size,
                timeout=start,
            )
        except Exception as error:  # noqa: BLE001 -- name the ranks that never came, if that is why
            absent = tuple(r for r in range(world_size) if not store.check([f"moekv/joined/{r}"]))
            if not absent:
                raise
            raise CollectiveError(
                f"{name_ranks(absent)} never joined the process group: rank {rank} waited "
                f"{time.monotonic() - began:.1f} s for it (start timeout {start_timeout_s:g} s). "
                f"Cause seen there: {first_line(error)}",
                absent,
            ) from error
        progress = store
    # every rank has joined: a peer keeping a collective waiting past timeout_s has hung (or died)
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return WorkerContext(
        rank, world_size, Communicator(rank, world_size, device, store=progress, group=group), device
    )


def _worker_main(
    rank, world_size, port, backend, timeout_s, start_timeout_s, function, args, results, environment
):
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(environment)
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=start_timeout_s)
        )
        context = join_group(backend, timeout_s, start_timeout_s, store, rank, world_size, rank)
        value = function(context, *args)
        results.put((rank, "ok", pickle.dumps(value)))
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 -- every failure must reach the parent
        message = f"{type(error).__name__}: {error}"
        if not isinstance(error, CollectiveError):
            message += "\n" + "".join(traceback.format_exception(error)[-4:])
        missing = error.missing if isinstance(error, CollectiveError) else ()
        results.put((rank, "error", (message, missing)))
        results.close()
        results.join_thread()
        os._exit(1)  # skip destroy_process_group, which can itself wait on dead peers


def launch(
    function,
    world_size: int,
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
) -> list:
    """Run function(context, *args) on world_size ranks: their return values in rank order, or
    WorkerFailed naming every rank that failed. The timeouts and grace_s: module docstring."""
    world_size = check_int("world_size", world_size, 1, MAX_INT32)
    timeout_s = check_seconds("timeout_s", timeout_s)
    start_timeout_s = check_seconds("start_timeout_s", start_timeout_s)
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not 0 <= grace_s <= 60:
        raise ValueError(f"grace_s={grace_s!r} must be a number of seconds from 0 to 60")
    if (
        not callable(function)
        or "<locals>" in getattr(function, "__qualname__", "<locals>")
        or getattr(function, "__module__", "__main__") == "__main__"
    ):
        raise ValueError(
            f"{function!r} must be a module-level function of an importable module: the "
            f"ranks are new processes that import it by name"
        )
    fault_from_environment()  # a bad MOEKV_FAULT fails here, not in every rank
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=start_timeout_s),
    )
    # Ranks start on Linux from a fork server, which imports torch and the rank programs once and then
    # forks each rank (0.2 s per launch of 2 ranks here, against 3 s spawning them, each importing
    # torch afresh: notebook 07's widget launches ranks at every change); elsewhere they are spawned
    # (Windows has no fork, and macOS frameworks are not safe to fork once loaded).
    method = "forkserver" if sys.platform.startswith("linux") else "spawn"
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["moekv_ref.parallel.programs", function.__module__])
    results = context.Queue()
    processes = [
        context.Process(
            target=_worker_main,
            daemon=True,
            args=(
                rank,
                world_size,
                store.port,
                default_backend(),
                timeout_s,
                start_timeout_s,
                function,
                args,
                results,
                dict(os.environ),
            ),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    values, errors = {}, {}  # by rank: its return value, its error message
    missing, failed_at = set(), None  # the ranks a peer waited for in vain; when the first failed
    try:
        while len(values) + len(errors) < world_size:
            with contextlib.suppress(queue_module.Empty):
                rank, status, payload = results.get(timeout=0.1)
                if status == "ok":
                    values[rank] = pickle.loads(payload)
                else:
                    errors[rank], behind = payload
                    missing.update(behind)
            for rank, process in enumerate(processes):
                if (
                    rank not in values
                    and rank not in errors
                    and process.exitcode not in (None, 0)
                    and results.empty()
                ):
                    errors[rank] = f"exited with code {process.exitcode} without reporting a result"
            if errors and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for rank, process in enumerate(processes):
                    if rank not in values and rank not in errors:
                        errors[rank] = (
                            f"killed by the launcher: still running {grace_s:g} s after another rank failed"
                        )
                break
    finally:
        for process in processes:
            if process.is_alive():
                process.join(timeout=0.5 if not errors else 0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    if errors:
        lines = [f"rank {rank}: {errors[rank]}" for rank in sorted(errors)]
        head = f"{len(errors)} of {world_size} ranks failed"
        if missing:
            their = "their" if len(missing) > 1 else "its"
            head = (
                f"{name_ranks(sorted(missing))} kept {their} peers waiting in vain (hung, dead "
                f"or never started); {head}"
            )
        fault_at = float(store.get(FAULT_KEY).decode()) if store.check([FAULT_KEY]) else None
        raise WorkerFailed(head + ":\n" + "\n".join(lines), time.time(), fault_at, tuple(sorted(missing)))
    return [values[rank] for rank in range(world_size)]
