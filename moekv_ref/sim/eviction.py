"""Serving simulation over a routing trace with per-device pools and a victim policy (no model).

Requests arrive together and wait in one FIFO line. Each step, in order:

 1. Plan: every running sequence appends its next tokens: a whole prefill (a new prompt, or the
    context of a sequence coming back from recompute) or one decode token. The trace says which rows
    they go to, so the blocks each device must give are known exactly.
 2. Evict: while some device is short, the most short one is handed to the policy
    (victims.py), which takes a whole sequence off (recompute or swap) or some rows (expert_lru);
    a victim's tokens leave the plan, and it goes back to the head of the line.
 3. Admit, only if nothing was evicted (admitting then would thrash): from the head of the line,
    while the sequence limit allows, the request's prefill (or swap-in) fits every device next to
    the plan, the prefill token budget allows, and the policy agrees (only the oracle vetoes).
 4. Allocate the plan on every device; a sequence whose last token is stored finishes and frees.

A request that could not fit some device even alone (its final rows on that device exceed the pool)
is refused on arrival: preemption frees only other sequences' memory.

Time: each step costs CostModel seconds for the tokens it computes (prefills, recomputes, decodes,
attention over their contexts) plus the swaps it makes. Goodput is tokens of finished requests per
step and per second. Every policy sees the same trace, pools, limits and cost model.

Dimension legend: S sequences of the trace, D devices, L layers, E experts, R = L * E rows per
sequence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.device_pools import DevicePools
from ..cache.rows import ceil_div
from .costs import CostModel
from .traces import RoutingTrace
from .victims import Candidate, Eviction, VictimPolicy, make_policy


@dataclass(frozen=True)
class EvictionSetup:
    """Pools and limits shared by every policy of one comparison."""
    blocks_per_device: int
    block_size: int = 16
    max_num_seqs: int = 32
    max_prefill_tokens: int = 4096      # prefill (and recompute) tokens admitted per step
    num_host_blocks: int = 0            # host swap space, in blocks (0: recompute only)


@dataclass
class EvictionRecord:
    step: int
    seq_id: int
    mode: str                           # recompute, swap, rows
    short_device: int
    freed: list[int]                    # blocks freed on each device
    num_rows: int                       # rows taken (all of the sequence's for whole evictions)


@dataclass
class EvictionStats:
    policy: str
    num_steps: int
    seconds: float                      # modelled
    finished_tokens: int                # output tokens of finished requests
    num_finished: int
    num_refused: int
    num_evictions: int                  # eviction events (rows of one sequence at once count once)
    num_victim_sequences: int           # sequences made to stop (by any eviction)
    recomputed_tokens: int
    swapped_bytes: int                  # out + in
    freed_on_short_device: int          # blocks freed on the short device, all evictions together
    used_blocks: torch.Tensor           # (steps, D) blocks in use after each step's allocation
    num_running: torch.Tensor           # (steps,)
    evictions: list[EvictionRecord] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.finished_tokens / max(1, self.num_steps)

    @property
    def tokens_per_second(self) -> float:
        return self.finished_tokens / max(self.seconds, 1e-12)

    @property
    def freed_per_eviction(self) -> float:
        return self.freed_on_short_device / max(1, self.num_evictions)

    def summary(self) -> dict:
        return {"policy": self.policy, "steps": self.num_steps, "modelled_seconds": self.seconds,
                "tokens_per_step": self.tokens_per_step, "tokens_per_second": self.tokens_per_second,
                "finished": self.num_finished, "refused": self.num_refused,
                "evictions": self.num_evictions, "victim_sequences": self.num_victim_sequences,
                "recomputed_tokens": self.recomputed_tokens, "swapped_bytes": self.swapped_bytes,
                "freed_on_short_device_per_eviction": self.freed_per_eviction}


class _TraceBlocks:
    """Blocks per device a sequence of the trace holds after its first t tokens, for every t."""

    def __init__(self, trace: RoutingTrace, device_of_row: torch.Tensor, num_devices: int, block_size: int):
        self.trace, self.device_of_row, self.D, self.P = trace, device_of_row, num_devices, block_size
        self.R = trace.num_layers * trace.num_experts
        self._cache: dict[int, torch.Tensor] = {}

    def row_counts(self, seq: int, start: int, stop: int) -> torch.Tensor:
        """(R,) tokens that tokens start..stop-1 of seq append to each row."""
        t = self.trace
        chosen = t.experts[int(t.offsets[seq]) + start: int(t.offsets[seq]) + stop].to(torch.int64)  # (n, L, K)
        local = torch.arange(t.num_layers)[None, :, None] * t.num_experts + chosen
        return torch.bincount(local[chosen >= 0], minlength=self.R)

    def trajectory(self, seq: int) -> torch.Tensor:
        """(len + 1, D): blocks on each device after the first t tokens, t = 0..len."""
        if seq not in self._cache:
            t = self.trace
            chosen = t.experts[int(t.offsets[seq]): int(t.offsets[seq + 1])].to(torch.int64)   # (n, L, K)
            local = torch.arange(t.num_layers)[None, :, None] * t.num_experts + chosen
            hits = torch.zeros(chosen.shape[0], self.R, dtype=torch.int64)                     # (n, R)
            hits.scatter_add_(1, local.clamp(min=0).reshape(chosen.shape[0], -1),
                              (chosen >= 0).to(torch.int64).reshape(chosen.shape[0], -1))
            counts = torch.cat([torch.zeros(1, self.R, dtype=torch.int64), hits.cumsum(0)])      # (n+1, R)
            one_hot = torch.nn.functional.one_hot(self.device_of_row, self.D)                   # (R, D)
            self._cache[seq] = ceil_div(counts, self.P) @ one_hot                               # (n+1, D)
        return self._cache[seq]


class EvictionSimulator:
    """One run of one policy (module docstring). Also the `state` the policy reads (victims.py)."""

    def __init__(self, trace: RoutingTrace, device_of_expert: torch.Tensor, setup: EvictionSetup,
                 policy: VictimPolicy | str, cost: CostModel):
        self.trace, self.setup, self.cost = trace, setup, cost
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        L, E = trace.num_layers, trace.num_experts
        self.R = L * E
        self.pools = DevicePools(L, E, setup.block_size, setup.blocks_per_device, device_of_expert,
                                 initial_num_seqs=setup.max_num_seqs + 1)
        self.D = self.pools.num_devices
        self.device_of_row = self.pools.device_of_expert.reshape(-1)                  # (R,)
        self.blocks = _TraceBlocks(trace, self.device_of_row, self.D, setup.block_size)
        S = trace.num_sequences
        self.lengths, self.prompts = trace.lengths, trace.prompt_lens
        self.stored = torch.zeros(S, dtype=torch.int64)      # tokens held in the pools
        self.progress = trace.prompt_lens.clone()            # tokens the sequence has reached
        self.order = torch.zeros(S, dtype=torch.int64)
        self.status = ["waiting"] * S                        # waiting running stalled swapped
        self.saved_counts: dict[int, torch.Tensor] = {}      # swapped: (R,) tokens per row
        self.host_free_blocks = setup.num_host_blocks
        self.last_used = torch.zeros(0, dtype=torch.int64)   # per pool row: step of its last append
        self.slot_seq: dict[int, int] = {}                   # pool slot -> trace sequence
        self.running: list[int] = []
        self.waiting: deque[int] = deque()
        self.step = 0
        self._counter = 0

    # ----- what policies may ask ---------------------------------------------------------------------
    def remaining_tokens(self, seq: int) -> int:
        return int(self.lengths[seq] - self.progress[seq])

    def _pool_tokens(self) -> torch.Tensor:
        return sum(m.num_computed_tokens for m in self.pools.managers)                # (slots * R,)

    def lru_rows(self, device: int):
        tokens = self._pool_tokens()
        self._grow_last_used(tokens.numel())
        on_device = (tokens > 0) & (self.device_of_row.repeat(tokens.numel() // self.R) == device)
        rows = on_device.nonzero().squeeze(1)
        rows = rows[torch.argsort(self.last_used[rows] * tokens.numel() + rows)]     # LRU, then row id
        seq_ids = torch.tensor([self.slot_seq[int(r) // self.R] for r in rows.tolist()], dtype=torch.int64)
        return rows, seq_ids, ceil_div(tokens[rows], self.setup.block_size)

    def future_block_steps(self, seq: int, device: int) -> int:
        """Blocks `seq` will hold on `device` summed over its remaining steps, if it keeps running
        (the belady policy's look at the future trace)."""
        return int(self.blocks.trajectory(seq)[int(self.stored[seq]) + 1:, device].sum())

    def fits_to_completion(self, seq: int) -> bool:
        """Would `seq`, admitted now, and every running sequence, each run to its end one token a step,
        fit every device at every future step? (The oracle's admission; reads the future trace.)"""
        num_blocks = self.pools.num_blocks                                            # (D,)
        # index 0 is the next step: a running sequence then holds stored + 1 tokens, the candidate
        # progress + 1 (this step is checked against the free blocks by the admission itself)
        paths = [self.blocks.trajectory(r)[int(self.stored[r]) + 1:] for r in self.running]   # (g, D) each
        paths.append(self.blocks.trajectory(seq)[int(self.progress[seq]) + 1:])
        horizon = max(p.shape[0] for p in paths)
        total = torch.zeros(horizon, self.D, dtype=torch.int64)
        for p in paths:
            total[: p.shape[0]] += p
        return bool((total <= num_blocks).all())

    # ----- helpers -----------------------------------------------------------------------------------
    def _grow_last_used(self, n: int) -> None:
        if self.last_used.numel() < n:
            self.last_used = torch.cat([self.last_used, torch.zeros(n - self.last_used.numel(), dtype=torch.int64)])

    def _slot_rows(self, seq: int) -> torch.Tensor:
        return self.pools.seq_index(seq) * self.R + torch.arange(self.R)

    def _new_blocks(self, pool_rows, num_new, tokens) -> torch.Tensor:
        P = self.setup.block_size
        old = tokens[pool_rows]
        return ceil_div(old + num_new, P) - ceil_div(old, P)

    def _demand(self, seq: int) -> tuple[torch.Tensor, int, int]:
        """What admitting seq takes now: (D,) blocks, prefill tokens, recomputed tokens."""
        if self.status[seq] == "swapped":
            counts = self.saved_counts[seq]
            blocks = torch.bincount(self.device_of_row, weights=ceil_div(counts, self.setup.block_size).double(),
                                    minlength=self.D).to(torch.int64)
            return blocks, 0, 0
        context = int(self.progress[seq])
        blocks = self.blocks.trajectory(seq)[context].clone()
        if self.status[seq] == "stalled":                   # its surviving rows are rebuilt too
            blocks -= self.pools.blocks_held([seq])[0]
        recomputed = context if self.status[seq] in ("stalled", "recompute") else 0
        return blocks, context, recomputed

    def _candidate(self, seq: int, held: torch.Tensor, step_blocks: torch.Tensor) -> Candidate:
        return Candidate(seq, int(self.order[seq]), int(self.stored[seq]), held, step_blocks)

    # ----- the run -----------------------------------------------------------------------------------
    def run(self, max_steps: int = 100_000) -> EvictionStats:
        started = time.perf_counter()
        trace, setup, cost, P = self.trace, self.setup, self.cost, self.setup.block_size
        S = trace.num_sequences
        refused = 0
        for s in range(S):
            final = self.blocks.trajectory(s)[-1]
            # the last token never needs storing to finish, but the trace's length is what it holds
            if (final > self.pools.num_blocks).any():
                self.status[s] = "refused"
                refused += 1
            else:
                self.waiting.append(s)
        used, running_counts, records = [], [], []
        finished_tokens = num_finished = recomputed = swapped_bytes = freed_short = 0
        num_evictions = 0
        victims: set[int] = set()
        seconds = 0.0
        block_bytes = P * trace.kv_bytes_per_slot
        while (self.running or self.waiting) and self.step < max_steps:
            step_seconds = cost.seconds_per_step
            tokens = self._pool_tokens()
            # 1. plan: every running sequence decodes one token (a prefill is done at admission)
            plan_seqs = torch.tensor(self.running, dtype=torch.int64)                        # (m,)
            trace_rows = trace.decode_appends(plan_seqs, self.stored[plan_seqs])             # (a,)
            slot_of = torch.zeros(S, dtype=torch.int64)
            slot_of[plan_seqs] = torch.tensor([self.pools.seq_index(x) for x in self.running], dtype=torch.int64)
            plan_rows = slot_of[trace_rows // self.R] * self.R + trace_rows % self.R          # (a,)
            position = torch.zeros(S, dtype=torch.int64)
            position[plan_seqs] = torch.arange(plan_seqs.numel())
            plan_owner = position[trace_rows // self.R]                                      # (a,) into plan_seqs
            plan_new = self._new_blocks(plan_rows, torch.ones_like(plan_rows), tokens)        # (a,)
            step_blocks = torch.zeros(plan_seqs.numel(), self.D, dtype=torch.int64)           # (m, D)
            step_blocks.index_put_((plan_owner, self.device_of_row[plan_rows % self.R]), plan_new, accumulate=True)
            in_plan = torch.ones(plan_seqs.numel(), dtype=torch.bool)                        # (m,)
            # 2. evict while a device is short
            evicted_now = False
            while True:
                need = step_blocks[in_plan].sum(0)
                free = self.pools.num_free_blocks
                if (need <= free).all():
                    break
                device = int((need - free).argmax())
                held = self.pools.blocks_by_slot()
                candidates = [self._candidate(s, held[self.pools.seq_index(s)], step_blocks[int(position[s])])
                              for s in self.running]
                if not candidates:
                    raise RuntimeError("a device is short with nothing running")
                eviction: Eviction = self.policy.choose(self, device, candidates)
                before = self.pools.num_free_blocks
                s = eviction.seq_id
                if eviction.mode == "rows":
                    self.pools.free_rows(eviction.rows)
                    num_rows = eviction.rows.numel()
                    if self.status[s] == "running":
                        self._stop(s, "stalled")
                        in_plan[position[s]] = False
                else:
                    num_rows = int((self._pool_tokens()[self._slot_rows(s)] > 0).sum())
                    if eviction.mode == "swap":
                        counts = self._pool_tokens()[self._slot_rows(s)].clone()
                        num_blocks = int(ceil_div(counts, P).sum())
                        self.saved_counts[s] = counts
                        self.host_free_blocks -= num_blocks
                        swapped_bytes += num_blocks * block_bytes
                        step_seconds += float(cost.swap_seconds(num_blocks)) / 2
                    self._release(s)
                    self._stop(s, "swapped" if eviction.mode == "swap" else "recompute")
                    in_plan[position[s]] = False
                freed = (self.pools.num_free_blocks - before).tolist()
                records.append(EvictionRecord(self.step, s, eviction.mode, device, freed, num_rows))
                freed_short += freed[device]
                num_evictions += 1
                victims.add(s)
                evicted_now = True
                tokens = self._pool_tokens()
            # 3. admit
            if not evicted_now:
                room = self.pools.num_free_blocks - step_blocks[in_plan].sum(0)
                prefill_budget = setup.max_prefill_tokens
                first = True
                while self.waiting and len(self.running) < setup.max_num_seqs:
                    s = self.waiting[0]
                    demand, prefill, recompute_tokens = self._demand(s)
                    if (demand > room).any() and not self.running:
                        # nothing runs, yet the head does not fit: stalled sequences' rows hold the
                        # memory (expert_lru); the policy drops rows until the head fits
                        device = int((demand - room).argmax())
                        eviction = self.policy.choose(self, device, [])
                        self.pools.free_rows(eviction.rows)
                        room = self.pools.num_free_blocks.clone()
                        continue
                    if (demand > room).any() or (prefill > prefill_budget and not first):
                        break
                    if not self.policy.admits(self, s):
                        break
                    self.waiting.popleft()
                    first = False
                    room -= demand
                    prefill_budget -= prefill
                    status = self.status[s]
                    if status == "stalled":
                        self._release(s)
                    self._counter += 1
                    self.order[s] = self._counter
                    index = self.pools.add_sequence(s)
                    self.slot_seq[index] = s
                    self.running.append(s)
                    self.status[s] = "running"
                    if status == "swapped":
                        counts = self.saved_counts.pop(s)
                        rows = (counts > 0).nonzero().squeeze(1)
                        self._allocate(index * self.R + rows, counts[rows])
                        num_blocks = int(ceil_div(counts, P).sum())
                        self.host_free_blocks += num_blocks
                        swapped_bytes += num_blocks * block_bytes
                        step_seconds += float(cost.swap_seconds(num_blocks)) / 2
                        self.stored[s] = self.progress[s]
                    else:
                        counts = self.blocks.row_counts(s, 0, prefill)
                        rows = (counts > 0).nonzero().squeeze(1)
                        self._allocate(index * self.R + rows, counts[rows])
                        self.stored[s] = prefill
                        recomputed += recompute_tokens
                        step_seconds += float(cost.recompute_seconds(prefill))
            # 4. allocate the plan, finish
            decoding = plan_seqs[in_plan]                                                    # (m',)
            keep = in_plan[plan_owner]                                                       # (a,)
            self._allocate(plan_rows[keep], torch.ones(int(keep.sum()), dtype=torch.int64))
            step_seconds += float(cost.decode_seconds(self.stored[decoding].to(torch.float64)).sum())
            self.stored[decoding] += 1
            self.progress[decoding] = torch.maximum(self.progress[decoding], self.stored[decoding])
            used.append(self.pools.num_used_blocks)
            running_counts.append(len(self.running))
            for s in list(self.running):
                if self.stored[s] == self.lengths[s]:
                    self._release(s)
                    self.running.remove(s)
                    self.status[s] = "finished"
                    finished_tokens += int(self.lengths[s] - self.prompts[s])
                    num_finished += 1
            seconds += step_seconds
            self.step += 1
        self.pools.assert_no_leak()
        assert self.host_free_blocks == setup.num_host_blocks, "host swap space leaked"
        return EvictionStats(self.policy.name, self.step, seconds, finished_tokens, num_finished, refused,
                             num_evictions, len(victims), recomputed, swapped_bytes, freed_short,
                             torch.stack(used) if used else torch.zeros(0, self.D, dtype=torch.int64),
                             torch.tensor(running_counts), records, time.perf_counter() - started)

    def _allocate(self, rows: torch.Tensor, num_new: torch.Tensor) -> None:
        self.pools.allocate_slots(rows, num_new, rows_are_distinct=True)
        self._grow_last_used(int(rows.max()) + 1 if rows.numel() else 0)
        self.last_used[rows] = self.step + 1

    def _release(self, seq: int) -> None:
        index = self.pools.seq_index(seq)
        self.pools.free(seq)
        del self.slot_seq[index]
        self.stored[seq] = 0

    def _stop(self, seq: int, status: str) -> None:
        """Take a running sequence off; it waits at the head of the line (status: recompute,
        swapped or stalled)."""
        if seq in self.running:
            self.running.remove(seq)
        self.status[seq] = status
        if seq not in self.waiting:
            self.waiting.appendleft(seq)


def simulate(trace: RoutingTrace, device_of_expert: torch.Tensor, setup: EvictionSetup, policy,
             cost: CostModel, max_steps: int = 100_000) -> EvictionStats:
    """Run one policy over the trace (module docstring)."""
    return EvictionSimulator(trace, device_of_expert, setup, policy, cost).run(max_steps)


def memory_time_bound(trace: RoutingTrace, device_of_expert: torch.Tensor, setup: EvictionSetup) -> dict:
    """A lower bound on the steps any policy needs, hence an upper bound on goodput per step.

    Each decode step of a sequence needs, on every device, the blocks its rows hold at that moment;
    a device holds at most its pool at any step. So the steps are at least, for every device,
    (sum over sequences and their decode steps of the blocks held there) / pool; also at least the
    longest sequence's decode steps plus one prefill step, and the decode steps / max_num_seqs.
    Refused requests (too large for a device alone) are left out, as they are by the runs."""
    pools = DevicePools(trace.num_layers, trace.num_experts, setup.block_size, setup.blocks_per_device,
                        device_of_expert)
    blocks = _TraceBlocks(trace, pools.device_of_expert.reshape(-1), pools.num_devices, setup.block_size)
    block_steps = torch.zeros(pools.num_devices, dtype=torch.int64)
    longest = decode_steps = tokens = 0
    for s in range(trace.num_sequences):
        path = blocks.trajectory(s)
        if (path[-1] > pools.num_blocks).any():
            continue
        prompt = int(trace.prompt_lens[s])
        block_steps += path[prompt:].sum(0)          # held at the prefill step and every decode step
        steps = path.shape[0] - prompt               # prefill + decode steps
        longest = max(longest, steps)
        decode_steps += steps
        tokens += int(trace.lengths[s]) - prompt
    steps = max(float((block_steps / pools.num_blocks).max()), longest, decode_steps / setup.max_num_seqs)
    return {"steps": steps, "finished_tokens": tokens, "tokens_per_step": tokens / steps}
