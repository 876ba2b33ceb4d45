"""Replaying a routing trace through a memory design, as a static batch in lock step: every
sequence is admitted and prefilled at step 0, then each step appends one decode token to every
running sequence, and a sequence is released after the step that stored its last token.

    utilization            = sum over steps of live KV bytes / sum of allocated KV bytes
    effective_utilization  = sum of live KV bytes / sum of (allocated KV bytes + metadata bytes)

are ratios of integrals over time, so a step weighs by the memory it holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .traces import RoutingTrace


@dataclass
class ReplayStats:
    design: str
    num_sequences: int
    num_steps: int
    slot_appends: int
    live_bytes_time_sum: int  # sum over steps of live KV bytes
    allocated_bytes_time_sum: int  # sum over steps of allocated KV bytes
    metadata_bytes_time_sum: int
    peak_bytes: int  # max over steps of allocated + metadata bytes
    decode_reads: int  # contiguous runs read by all decode steps
    decode_tokens: int  # decode tokens (one per running sequence per step)
    seconds: float  # wall time of the replay, trace lookups included

    @property
    def utilization(self) -> float:
        return self.live_bytes_time_sum / max(1, self.allocated_bytes_time_sum)

    @property
    def effective_utilization(self) -> float:
        return self.live_bytes_time_sum / max(1, self.allocated_bytes_time_sum + self.metadata_bytes_time_sum)

    @property
    def reads_per_decode_token(self) -> float:
        """Contiguous runs (blocks) one decode token's attention reads, over all layers."""
        return self.decode_reads / max(1, self.decode_tokens)


def replay(
    trace: RoutingTrace, design, count_reads: bool = False, max_steps: int | None = None
) -> ReplayStats:
    """max_steps stops early, leaving the design as it is then (to draw its memory mid-run)."""
    started = time.perf_counter()
    S, lengths, bytes_per_slot = trace.num_sequences, trace.lengths, trace.kv_bytes_per_slot
    everyone = torch.arange(S)
    design.admit(everyone, lengths)
    rows, num_new = trace.prefill_appends(everyone)  # (a,), (a,)
    design.append(rows, num_new)
    live = int(num_new.sum())
    appends, steps = live, 0
    live_sum = allocated_sum = metadata_sum = peak = reads = decode_tokens = 0
    stored = trace.prompt_lens.clone()  # (S,) tokens stored per sequence
    finished = torch.zeros(S, dtype=torch.bool)
    while True:
        allocated, metadata = design.allocated_slots() * bytes_per_slot, design.metadata_bytes()
        live_sum += live * bytes_per_slot
        allocated_sum += allocated
        metadata_sum += metadata
        peak = max(peak, allocated + metadata)
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
        done = ((stored == lengths) & ~finished).nonzero().squeeze(1)
        if done.numel():
            live -= design.live_slots_of(done)
            design.release(done)
            finished[done] = True
        running = (~finished).nonzero().squeeze(1)  # (m,)
        if running.numel() == 0:
            break
        rows = trace.decode_appends(running, stored[running])[0]  # (a,)
        design.append(rows, torch.ones_like(rows))
        live += rows.numel()
        appends += rows.numel()
        stored[running] += 1
        if count_reads:
            reads += design.reads(rows)
            decode_tokens += running.numel()
    return ReplayStats(
        design.name,
        S,
        steps,
        appends,
        live_sum,
        allocated_sum,
        metadata_sum,
        peak,
        reads,
        decode_tokens,
        time.perf_counter() - started,
    )


def max_concurrent_sequences(trace: RoutingTrace, make_design, budget_bytes: int) -> int:
    """The largest n such that the trace's first n sequences, run together to completion, never
    take more than `budget_bytes` (allocated + metadata). make_design(n) builds a fresh design."""

    def fits(n: int) -> bool:
        return n == 0 or replay(trace.subset(list(range(n))), make_design(n)).peak_bytes <= budget_bytes

    low, high = 0, trace.num_sequences  # fits(low) holds; find the largest n that fits
    if fits(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low
