"""Collectives that count what they move, time themselves, and name who failed.

Every byte that travels between ranks in this package goes through a `Communicator`, which calls
only torch.distributed collectives (`all_to_all_single`, `all_gather`, `broadcast`) and records, per
call: the decode step, the collective, a category (what the bytes are: hidden states, cached K/V,
split sizes, ...), the bytes this rank sent to and received from *other* ranks, and the seconds the
call took. A rank's chunk to itself is a local copy and is not counted as moved.

Counted bytes are logical: what leaves one rank for another. How a backend routes them (a ring, a
tree, NVLink or a NIC) changes the bytes on each physical link, not these counts; the cost model
(moekv_ref/costs.py) turns the logical counts into time with a stated bandwidth.

Uneven all-to-all: `all_to_all_single` with split sizes. The receiver cannot know how many rows each
peer will send, so the sizes are exchanged first (an all-to-all of one int64 per peer, counted under
"split_sizes") unless the caller already knows them. (On gloo the list form, `all_to_all`, rejects
uneven sizes; the single-tensor form does not.)

Failure: before each collective a rank writes its progress (the collective's sequence number and
name) to the process group's key-value store. When a collective raises (a peer died: the connection
closes; a peer hangs: the group's timeout runs out, launcher.py), the rank reads every peer's progress
and raises a CollectiveError whose message starts with the ranks that never reached this collective
(the hung or dead ones, also in its `missing`), then says what they were last doing, which rank
waited and for how long. The store should live outside the workers (the Python launcher hosts it in
the parent process; torchrun's agent hosts its own), so that it outlives a dead rank.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed on this rank; the message names the ranks that never reached it, then the
    collective, this rank and how long it waited. missing: those ranks (empty if every peer reached it
    or their progress could not be read)."""

    def __init__(self, message: str, missing: tuple = ()):
        super().__init__(message)
        self.missing = tuple(missing)


@dataclass
class CollectiveRecord:
    step: int
    collective: str          # "all_to_all_single", "all_gather", "broadcast"
    category: str            # what travelled: "attention_dispatch", "kv_context", "split_sizes", ...
    bytes_sent: int          # to other ranks
    bytes_received: int      # from other ranks
    seconds: float


class Communicator:
    """torch.distributed collectives with byte counters (per rank, per step) and failure naming.

    step: set by the caller (`begin_step`) so that every record says which decode step it belongs to.
    store: the process group's key-value store, for progress and failure naming (None: the error
    names only the collective and this rank)."""

    def __init__(self, rank: int, world_size: int, device: str | torch.device = "cpu", store=None,
                 group=None):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.store = store
        self.group = group
        self.step = -1
        self.records: list[CollectiveRecord] = []
        self._sequence = 0

    # ----- bookkeeping ------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step

    def reset(self) -> None:
        self.records = []
        self.step = -1

    def bytes_by_step(self) -> dict[int, dict[str, int]]:
        """{step: {category: bytes sent to other ranks}} for this rank."""
        table: dict[int, dict[str, int]] = {}
        for record in self.records:
            per_category = table.setdefault(record.step, {})
            per_category[record.category] = per_category.get(record.category, 0) + record.bytes_sent
        return table

    def seconds_by_step(self) -> dict[int, float]:
        table: dict[int, float] = {}
        for record in self.records:
            table[record.step] = table.get(record.step, 0.0) + record.seconds
        return table

    # ----- collectives ------------------------------------------------------------------------------
    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int], category: str,
                   recv_counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Send rows send_counts[r] of tensor (rows grouped by destination rank, in rank order) to
        rank r; returns the rows received (grouped by source rank) and recv_counts. When recv_counts
        is None the split sizes are exchanged first."""
        if len(send_counts) != self.world_size or sum(send_counts) != tensor.shape[0]:
            raise ValueError(f"send_counts={send_counts} must have {self.world_size} entries summing "
                             f"to the {tensor.shape[0]} rows of the tensor")
        if recv_counts is None:
            sizes = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
            received_sizes = torch.empty_like(sizes)
            self._run("all_to_all_single", "split_sizes", sizes.element_size(), sizes.element_size(),
                      lambda: dist.all_to_all_single(received_sizes, sizes, group=self.group),
                      [1] * self.world_size, [1] * self.world_size)
            recv_counts = received_sizes.tolist()
        tensor = tensor.contiguous()
        row_shape = tuple(tensor.shape[1:])
        out = tensor.new_empty((sum(recv_counts),) + row_shape)
        row_bytes = tensor[0:0].element_size() * int(torch.Size(row_shape).numel())
        self._run("all_to_all_single", category, row_bytes, row_bytes,
                  lambda: dist.all_to_all_single(out, tensor, recv_counts, send_counts, group=self.group),
                  send_counts, recv_counts)
        return out, recv_counts

    def all_gather(self, tensor: torch.Tensor, category: str) -> list[torch.Tensor]:
        """Every rank's tensor (same shape on every rank), in rank order."""
        source = tensor.contiguous().to(self.device)
        outs = [torch.empty_like(source) for _ in range(self.world_size)]
        nbytes = source.numel() * source.element_size()
        ones = [1] * self.world_size
        self._run("all_gather", category, nbytes, nbytes,
                  lambda: dist.all_gather(outs, source, group=self.group), ones, ones)
        return [out.to(tensor.device) for out in outs]

    def broadcast(self, tensor: torch.Tensor, src: int, category: str) -> torch.Tensor:
        """tensor from rank src, in place on every rank."""
        nbytes = tensor.numel() * tensor.element_size()
        sends = [int(self.rank == src)] * self.world_size
        receives = [int(r == src) for r in range(self.world_size)]
        on_device = tensor.to(self.device)
        self._run("broadcast", category, nbytes, nbytes,
                  lambda: dist.broadcast(on_device, src, group=self.group), sends, receives)
        tensor.copy_(on_device)
        return tensor

    # ----- one call, counted and guarded ----------------------------------------------------------------
    def _run(self, collective: str, category: str, send_unit: int, recv_unit: int, call,
             send_counts: list[int], recv_counts: list[int]) -> None:
        self._sequence += 1
        label = f"{collective} #{self._sequence} ({category}, step {self.step})"
        if self.store is not None:
            self.store.set(f"moekv/progress/{self.rank}", f"{self._sequence}|{label}")
        start = time.perf_counter()
        try:
            call()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as error:   # gloo raises RuntimeError, NCCL DistBackendError: both are failures
            message, missing = self._diagnose(label, error, time.perf_counter() - start)
            raise CollectiveError(message, missing) from error
        seconds = time.perf_counter() - start
        peers = [r for r in range(self.world_size) if r != self.rank]
        self.records.append(CollectiveRecord(
            self.step, collective, category,
            bytes_sent=send_unit * sum(send_counts[r] for r in peers),
            bytes_received=recv_unit * sum(recv_counts[r] for r in peers),
            seconds=seconds))

    def _diagnose(self, label: str, error: Exception, waited: float) -> tuple[str, tuple]:
        """(message, missing ranks): which ranks never reached this collective, read from the store's
        progress keys, named first; then this rank, how long it waited, and the backend's cause."""
        cause = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        seen = f"rank {self.rank} waited {waited:.1f} s in it. Cause seen there: {cause}"
        if self.store is None:
            return f"{label} failed on rank {self.rank} after {waited:.1f} s: {cause}", ()
        behind, unknown = {}, []
        try:
            self.store.set_timeout(datetime.timedelta(seconds=2))
        except Exception:
            pass
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            try:
                key = f"moekv/progress/{peer}"
                if not self.store.check([key]):
                    behind[peer] = "never started a collective"
                    continue
                sequence, last = self.store.get(key).decode().split("|", 1)
                if int(sequence) < self._sequence:
                    behind[peer] = f"last reached {last}"
            except Exception:
                unknown.append(peer)
        if behind:
            ranks = sorted(behind)
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            details = "; ".join(f"rank {peer} {behind[peer]}" for peer in ranks)
            return (f"{who} never reached {label}: hung or dead ({details}); {seen}", tuple(ranks))
        if unknown:
            return (f"{label} failed on rank {self.rank}: could not read the progress of ranks {unknown}; "
                    f"{seen}", ())
        return f"{label} failed on rank {self.rank} although every peer reached it; {seen}", ()
