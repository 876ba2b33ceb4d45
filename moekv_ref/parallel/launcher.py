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

A rank whose collective failed first waits up to comm.SETTLE_S (2 s) for its peers to reach the
collective or fail too, so that it names only the ranks that did neither. When a rank fails, the
parent gives the others `grace_s` (3 s) to report (plus SETTLE_S if the first failure is a rank
gone without a word), kills the rest (a hung rank never returns) and raises WorkerFailed, naming
first the ranks that kept a peer waiting: every rank is gone timeout_s + SETTLE_S + grace_s = 20 s
after a hang. Under torchrun (apps/parallel_run.py) the waiting rank kills the silent ranks on its
machine (kill_silent_peers: torchrun's SIGTERM cannot end a stopped one, and its SIGKILL comes 30 s
later) and exits, so it is torchrun's "Root Cause", and torchrun ends the others within its 0.1 s
monitor interval: about timeout_s + SETTLE_S + 1 s (18 s; the kill waits for the next whole second,
so that torchrun's root cause stays the rank with the message). tests/spec/test_parallel_failure.py
measures both.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_module
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..validation import MAX_INT32, check_int, check_seconds
from .comm import SETTLE_S, CollectiveError, Communicator, first_line, name_ranks

FAULT_KEY = "moekv/fault_at"  # where an injected fault notes its wall-clock time
FAULT_ENV = "MOEKV_FAULT"  # test-only fault injection: see Fault
FAULT_MODES = ("die", "hang", "stop", "slow_start")
DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_TIMEOUT_S = 15.0  # a collective's wait for a peer
DEFAULT_GRACE_S = 3.0
PROCESS_GROUP_BACKENDS = ("gloo", "nccl")


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
    """MOEKV_FAULT=MODE@RANK:AT: "die", "hang" (sleep) or "stop" (SIGSTOP: nothing runs, not even a
    signal handler) at the start of decode step AT (0: the prefill;
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


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_backend(backend: str | None) -> str:
    """The backend the ranks will use: backend itself, one of PROCESS_GROUP_BACKENDS (NCCL only with CUDA), or
    default_backend() for None."""
    if backend is None:
        return default_backend()
    if backend not in PROCESS_GROUP_BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not one of {PROCESS_GROUP_BACKENDS} (or None: {default_backend()!r} here)"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which this machine lacks: use 'gloo' (or None)")
    return backend


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
        store, rank, world_size = environment_store(start_timeout_s)
    store.set(f"moekv/joined/{rank}", "1")  # progress keys, for naming a failed rank, live here too
    store.set(f"moekv/process/{rank}", f"{socket.gethostname()}|{os.getpid()}")  # see kill_silent_peers
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
    # every rank has joined: a peer keeping a collective waiting past timeout_s has hung (or died)
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    return WorkerContext(
        rank, world_size, Communicator(rank, world_size, device, store=store, group=group), device
    )


def environment_store(start_timeout_s: float):
    """(store, rank, world_size) from the environment torchrun sets (env://: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). Under torchrun the store is its agent's, already up, and the ranks
    join the process group through it as launch's ranks do through the parent's."""
    try:
        return next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=start_timeout_s)))
    except Exception as error:  # noqa: BLE001 -- say which store could not be reached, and for how long
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise CollectiveError(
            f"rank {os.environ.get('RANK', '?')} could not set up the rendezvous store at {where} "
            f"within the start timeout ({start_timeout_s:g} s): {first_line(error)}"
        ) from error


def kill_silent_peers(store, ranks) -> list[tuple[int, int]]:
    """SIGKILL those of `ranks` that run on this machine as this process's siblings (children of the
    same torchrun agent, checked in /proc, so a reused process id is left alone): (rank, pid) of
    each. For a rank that timed out waiting for them under torchrun, which ends the other ranks
    with SIGTERM and only 30 s later with SIGKILL: a stopped (SIGSTOP) rank never acts on a SIGTERM,
    so it would outlive the run by 30 s. A silent rank on another machine is left to its own agent.
    Under launch the parent kills every rank still running after the grace; nothing to do here."""
    if not os.path.isdir("/proc"):
        return []
    killed = []
    for rank in ranks:
        try:
            key = f"moekv/process/{rank}"
            if not store.check([key]):  # never joined: no process to end
                continue
            host, pid = store.get(key).decode().split("|")
            pid = int(pid)
            with open(f"/proc/{pid}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])  # after "pid (name) state"
            if host != socket.gethostname() or parent != os.getppid():
                continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, RuntimeError):  # gone already, or the store out of reach
            continue
        killed.append((rank, pid))
    return killed


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
    backend: str | None = None,
) -> list:
    """Run function(context, *args) on world_size ranks: their return values in rank order, or
    WorkerFailed naming every rank that failed. The timeouts and grace_s: module docstring; backend:
    one of PROCESS_GROUP_BACKENDS, by default NCCL where CUDA is available and gloo elsewhere."""
    world_size = check_int("world_size", world_size, 1, MAX_INT32)
    backend = check_backend(backend)
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
                backend,
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
    missing = set()  # the ranks a peer waited for in vain
    failed_at = None  # when the first rank failed
    kill_at = None  # when the ranks still running are killed
    reported = False  # whether a rank has reported an error (not only exited)
    try:
        while len(values) + len(errors) < world_size:
            with contextlib.suppress(queue_module.Empty):
                rank, status, payload = results.get(timeout=0.1)
                if status == "ok":
                    values[rank] = pickle.loads(payload)
                else:
                    errors[rank], behind = payload
                    missing.update(behind)
                    reported = True
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
                # a rank reports after settling (comm.SETTLE_S); if the first failure is a rank gone
                # without a word, the others' collectives fail now and they settle before reporting
                kill_at = failed_at + grace_s + (0.0 if reported else SETTLE_S)
            if kill_at is not None and time.monotonic() > kill_at:
                waited = time.monotonic() - failed_at
                for rank, process in enumerate(processes):
                    if rank not in values and rank not in errors:
                        errors[rank] = (
                            f"killed by the launcher: still running {waited:.1f} s after another rank failed"
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
