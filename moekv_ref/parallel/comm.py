"""Collectives that count what they move, time themselves, and name who failed.

Every byte that travels between ranks in this package goes through a `Communicator`, which records
per call the step, a category (hidden states, cached K/V, split sizes, ...), the bytes sent to
*other* ranks and the seconds. The bytes are logical: how a backend routes them (ring, tree,
NVLink, NIC) changes the bytes per link, not these counts; moekv_ref/costs.py turns them into time.

Failure: before each collective a rank writes its progress to the key-value store, which lives
outside the workers (the launcher's parent process, or torchrun's agent) and so outlives a dead
rank. When a collective raises, the rank notes its failure there, waits briefly for its peers to
reach the collective or note theirs (a healthy peer may still be on its way), and raises a
CollectiveError naming first the ranks that did neither.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

SETTLE_S = 2.0  # after a failed collective, how long a rank waits for its peers to reach it or fail


class CollectiveError(RuntimeError):
    """A collective failed on this rank. missing: the ranks that never reached it (or ())."""

    def __init__(self, message: str, missing: tuple = ()):
        super().__init__(message)
        self.missing = tuple(missing)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def name_ranks(ranks) -> str:
    """Ranks as a message names them: rank 1, or ranks 1, 3."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@dataclass
class CollectiveRecord:
    step: int
    category: str  # what travelled: "attention_dispatch", "kv_context", "split_sizes", ...
    bytes_sent: int  # to other ranks
    seconds: float


class Communicator:
    """The caller sets `step`, the step that records belong to. store: the key-value store for
    progress (None: errors name only the collective and this rank)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, store, group):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.store = store
        self.group = group
        self.step = -1
        self.records: list[CollectiveRecord] = []
        self._sequence = 0

    def reset(self) -> None:
        self.records = []
        self.step = -1

    def start_step(self, step: int) -> None:
        """The collectives from now on belong to `step` (their records and timeout messages say so)."""
        self.step = step

    def bytes_by_step(self) -> dict[int, dict[str, int]]:
        """{step: {category: bytes sent to other ranks}} for this rank."""
        table: dict[int, dict[str, int]] = {}
        for record in self.records:
            table.setdefault(record.step, Counter())[record.category] += record.bytes_sent
        return {step: dict(per_category) for step, per_category in table.items()}

    def seconds_by_step(self) -> dict[int, float]:
        table: Counter = Counter()
        for record in self.records:
            table[record.step] += record.seconds
        return dict(table)

    def all_to_all(
        self,
        tensor: torch.Tensor,
        send_counts: list[int],
        category: str,
        recv_counts: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Send send_counts[r] rows of tensor (grouped by destination rank) to rank r, through
        `all_to_all_single` (gloo's list form rejects uneven sizes): the rows received, grouped by
        source rank, on this rank's device, and recv_counts (exchanged first when None)."""
        if len(send_counts) != self.world_size or sum(send_counts) != tensor.shape[0]:
            raise ValueError(
                f"send_counts={send_counts} must have {self.world_size} entries summing "
                f"to the {tensor.shape[0]} rows of the tensor"
            )
        if recv_counts is None:
            sizes = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
            received_sizes = torch.empty_like(sizes)
            self._run(
                "all_to_all_single",
                "split_sizes",
                sizes.element_size(),
                [1] * self.world_size,
                lambda: dist.all_to_all_single(received_sizes, sizes, group=self.group),
            )
            recv_counts = received_sizes.tolist()
        tensor = tensor.to(self.device).contiguous()  # NCCL takes CUDA tensors only
        out = tensor.new_empty((sum(recv_counts),) + tuple(tensor.shape[1:]))
        row_bytes = tensor.element_size() * tensor.shape[1:].numel()
        self._run(
            "all_to_all_single",
            category,
            row_bytes,
            send_counts,
            lambda: dist.all_to_all_single(out, tensor, recv_counts, send_counts, self.group),
        )
        return out, recv_counts

    def broadcast(self, tensor: torch.Tensor, src: int, category: str) -> None:
        """tensor from rank src, in place on every rank."""
        on_device = tensor.to(self.device)
        self._run(
            "broadcast",
            category,
            tensor.numel() * tensor.element_size(),
            [int(self.rank == src)] * self.world_size,
            lambda: dist.broadcast(on_device, src, group=self.group),
        )
        tensor.copy_(on_device)

    def _run(self, collective: str, category: str, unit: int, send_counts: list[int], call) -> None:
        """call(), counted as send_counts[r] units of `unit` bytes to each rank r, and guarded."""
        self._sequence += 1
        label = f"{collective} #{self._sequence} ({category}, step {self.step})"
        if self.store is not None:
            self.store.set(f"moekv/progress/{self.rank}", f"{self._sequence}|{label}")
        start = time.perf_counter()
        try:
            call()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as error:  # gloo raises RuntimeError, NCCL DistBackendError: both are failures
            message, missing = self._diagnose(label, error, time.perf_counter() - start)
            raise CollectiveError(message, missing) from error
        sent = unit * (sum(send_counts) - send_counts[self.rank])
        self.records.append(CollectiveRecord(self.step, category, sent, time.perf_counter() - start))

    def _diagnose(self, label: str, error: Exception, waited: float) -> tuple[str, tuple]:
        """(message, missing ranks): the ranks that never reached this collective first, then this
        rank, how long it waited, and the backend's cause. This rank notes in the store that it
        failed here, then gives its peers up to SETTLE_S to reach the collective or note their own
        failure: a healthy peer still on its way (the moment a dead rank's connections close, the
        others are not all in the collective yet) is not named; a dead or hung one does neither."""
        cause = first_line(error)
        seen = f"rank {self.rank} waited {waited:.1f} s in it. Cause seen there: {cause}"
        if self.store is None:
            return f"{label} failed on rank {self.rank} after {waited:.1f} s: {cause}", ()
        with contextlib.suppress(Exception):
            self.store.set_timeout(datetime.timedelta(seconds=2))
            self.store.set(f"moekv/failed/{self.rank}", str(self._sequence))
        deadline = time.monotonic() + SETTLE_S
        behind, unknown = self._peers_behind()
        while behind and time.monotonic() < deadline:
            time.sleep(0.05)
            behind, unknown = self._peers_behind()
        if behind:  # ascending, as peers are
            details = "; ".join(f"rank {peer} {reason}" for peer, reason in behind.items())
            return (
                f"{name_ranks(list(behind))} never reached {label}: hung or dead ({details}); {seen}",
                tuple(behind),
            )
        if unknown:
            return (
                f"{label} failed on rank {self.rank}: could not read the progress of ranks {unknown}; {seen}",
                (),
            )
        return f"{label} failed on rank {self.rank} although every peer reached it; {seen}", ()

    def _peers_behind(self) -> tuple[dict[int, str], list[int]]:
        """({peer: how far it got} for the peers that neither reached this collective nor noted a
        failure of their own, [peers whose progress could not be read])."""
        behind, unknown = {}, []
        for peer in sorted(set(range(self.world_size)) - {self.rank}):
            try:
                if self.store.check([f"moekv/failed/{peer}"]):
                    continue  # alive: it failed in a collective too, and says so itself
                key = f"moekv/progress/{peer}"
                if not self.store.check([key]):
                    behind[peer] = "never started a collective"
                    continue
                sequence, last = self.store.get(key).decode().split("|", 1)
                if int(sequence) < self._sequence:
                    behind[peer] = f"last reached {last}"
            except Exception:
                unknown.append(peer)
        return behind, unknown
