"""Start N ranks from Python (a test, a notebook, a benchmark) and collect what each returns.

    results = launch(module_level_function, world_size=4, args=(spec,))

`launch` spawns one process per rank (the "spawn" start method, so the worker must be a function
importable from a module: notebooks and tests pass functions of moekv_ref.parallel.programs). Each
process joins one process group (gloo on CPU, NCCL when CUDA is available and backend=None), builds a
`Communicator`, calls `function(context, *args)` and sends its return value back to the parent.

The key-value store that the ranks rendezvous through lives in the parent, so it outlives any rank:
a rank that sees a collective fail can still read how far its peers got (comm.py names them).

Failure: `timeout_s` goes to init_process_group, so a collective waiting on a rank that hangs raises
after that many seconds instead of the 30-minute default; a dead rank makes its peers' collectives
raise at once (its connections close). As soon as one rank fails, the parent gives the others
`grace_s` to report their own error, then kills whoever is left (a hung rank never returns on its
own) and raises WorkerFailed with every rank's message. `torchrun` does the same for
`python -m moekv_ref.parallel`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import Communicator


FAULT_KEY = "moekv/fault_at"   # where an injected fault notes its wall-clock time


class WorkerFailed(RuntimeError):
    """One or more ranks failed; the message has each failed rank's error. ended_at: wall-clock time
    when every rank was gone; fault_at: when an injected fault happened (None if none was noted)."""

    def __init__(self, message: str, ended_at: float, fault_at: float | None):
        super().__init__(message)
        self.ended_at = ended_at
        self.fault_at = fault_at


@dataclass
class WorkerContext:
    """What a worker function receives: its rank, the world size and the counting communicator."""
    rank: int
    world_size: int
    comm: Communicator
    device: torch.device


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker_main(rank, world_size, port, backend, timeout_s, function, args, results):
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.PrefixStore("process_group", store), rank=rank,
                                world_size=world_size, timeout=timeout)
        comm = Communicator(rank, world_size, device, store=store)
        value = function(WorkerContext(rank, world_size, comm, device), *args)
        results.put((rank, "ok", pickle.dumps(value)))
        dist.destroy_process_group()
    except BaseException as error:   # noqa: BLE001: every failure must reach the parent
        message = f"{type(error).__name__}: {error}"
        if not isinstance(error, Exception) or type(error).__name__ != "CollectiveError":
            message += "\n" + "".join(traceback.format_exception(error)[-4:])
        results.put((rank, "error", message))
        results.close()
        results.join_thread()
        os._exit(1)   # skip destroy_process_group, which can itself wait on dead peers


def launch(function, world_size: int, args: tuple = (), backend: str | None = None,
           timeout_s: float = 20.0, grace_s: float = 3.0) -> list:
    """Run function(context, *args) on world_size ranks; returns the ranks' return values in rank
    order, or raises WorkerFailed naming every rank that failed (within timeout_s + grace_s of a
    failure, whatever the failed rank does)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not one of ('gloo', 'nccl')")
    if not callable(function) or "<locals>" in getattr(function, "__qualname__", "<locals>") \
            or getattr(function, "__module__", "__main__") == "__main__":
        raise ValueError(f"{function!r} must be a module-level function of an importable module: the "
                         f"ranks are spawned processes that import it by name")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_worker_main, daemon=True,
                                 args=(rank, world_size, store.port, backend, timeout_s, function, args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    values: dict[int, object] = {}
    errors: dict[int, str] = {}
    failed_at = None
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.1)
                if status == "ok":
                    values[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
            except queue_module.Empty:
                pass
            for rank, process in enumerate(processes):
                if rank not in values and rank not in errors and process.exitcode not in (None, 0) \
                        and results.empty():
                    errors[rank] = f"exited with code {process.exitcode} without reporting a result"
            if errors and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for rank, process in enumerate(processes):
                    if rank not in values and rank not in errors:
                        errors[rank] = "killed by the launcher: still running after another rank failed"
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
        fault_at = float(store.get(FAULT_KEY).decode()) if store.check([FAULT_KEY]) else None
        raise WorkerFailed(f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(lines), time.time(), fault_at)
    return [values[rank] for rank in range(world_size)]
