"""Serving over a routing trace with per-device pools: the engine's own Scheduler, with the trace
playing the model.

The runner builds what the engine builds (per-device pools, a ModelShape, the real Scheduler and its
policies), refuses what `LLMEngine.add_request` refuses, and each step runs `schedule`, the model's
part (the scheduled tokens appended, blocks only, to the rows the trace routed them to), then
`update_from_output`. So every number, the scheduler's worst-case caution included, is one the
engine would produce on the same routing (tests/spec/test_sim_vs_engine.py checks it step by step; the
README's eviction section reads the numbers). Steps cost CostModel seconds (costs.py); the offline
policies (oracle, belady) read the trace's future through a TraceFuture. Requests may arrive in
time (`arrivals`: the clock is the steps' modelled seconds), and each one's first-token and finish
times are recorded (sim/workloads.py turns them into TTFT, TPOT and goodput). Under optimistic
reservation a step whose appends find a device short is undone and retried, as the engine does.

Multi-turn sessions (`follows`): a turn arrives a think time after the turn before it finished, and
with prefix caching (`RunnerSetup.prefix_caching`: the engine's PrefixCachingKVCacheManager) it
starts from what that turn left in each (layer, expert) row, found by the trace's token ids. The
runner then records, as paged.py does, the position of every token it appends, and each step
"samples" the trace's next token, so a request's tokens are the conversation's.

Dimension legend: D devices, L layers, E experts.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from ..cache.block_pool import OutOfBlocksError
from ..cache.kv_cache_manager import KVCacheManager
from ..cache.prefix_caching_manager import PrefixCachingKVCacheManager
from ..cache.rows import ceil_div
from ..costs import CostModel
from ..engine.demand import (
    blocks_held_per_device,
    step_need,
    worst_case_lifetime_blocks_per_device,
    worst_case_step_blocks_per_device,
)
from ..engine.memory import ModelShape
from ..engine.request import Request
from ..engine.reservation import ReservationPolicy
from ..engine.scheduler_config import SchedulerConfig
from ..engine.scheduler_factory import make_scheduler
from ..engine.scheduler_output import EvictionRecord
from ..engine.swap import COPY
from ..engine.undo import Snapshot
from ..engine.victims import VICTIM_POLICIES, OfflinePolicy, VictimPolicy
from ..sampling import SamplingParams
from ..validation import MAX_BLOCKS, check_device_table, check_int, number
from .clairvoyant import ClairvoyantReservation
from .counting import CountingKVCacheManager
from .fast_scheduler import FastScheduler
from .traces import RoutingTrace


@dataclass(frozen=True)
class RunnerSetup:
    """Pools and limits shared by every policy of one comparison."""

    blocks_per_device: int
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096  # tokens of one step (prefills, recomputes, decodes)
    num_host_blocks: int = 0  # host swap space, in blocks (0: preemption by recompute)
    admission: str = "optimistic"  # the scheduler's admission policy (admission.py)
    # "worst_case", "optimistic" (a step that runs short is undone and retried), "calibrated" (the
    # chunk scheduled last leaves a step that runs short), "clairvoyant" (exactly what the trace will
    # take: sim/clairvoyant.py), or a ReservationPolicy object, used as given (one run's)
    reservation: str | ReservationPolicy = "worst_case"
    prefix_caching: bool = False  # the manager keeps full blocks findable by prefix (cache/prefix_cache.py)
    # True: the manager lists every row's block ids, as the engine's does. False: it lists them only
    # where a prefix cache or swap space reads them, and otherwise counts blocks per row and device
    # (CountingKVCacheManager, counting.py): the same decisions, a step taking 55-60% of the time at
    # 64 experts
    list_block_ids: bool = False


@dataclass
class RunnerStats:
    policy: str
    num_steps: int
    seconds: float  # modelled
    finished_tokens: int  # generated tokens of finished requests
    num_finished: int
    num_refused: int
    num_evictions: int  # victims chosen (a row eviction counts once)
    num_victim_sequences: int  # distinct requests made to stop
    recomputed_tokens: int
    swapped_bytes: int  # out + in
    freed_on_short_device: int  # blocks freed on the short device, all evictions together
    used_blocks: torch.Tensor  # (steps, D) blocks in use after each step's appends
    num_running: torch.Tensor  # (steps,) running after each step's scheduling
    evictions: list[EvictionRecord] = field(default_factory=list)
    events: list[tuple[int, int, str]] = field(
        default_factory=list
    )  # (step, request id, admitted/resumed/preempted)
    # per trace sequence (S,) float64 modelled seconds, NaN where it never happened (refused)
    num_retries: int = 0  # tries undone for lack of blocks (optimistic reservation)
    thrown_away_tokens: int = 0  # tokens those tries had scheduled: forward work thrown away
    thrown_away_seconds: float = (
        0.0  # modelled time of those tries (their layers up to the fault), in `seconds`
    )
    num_repairs: int = 0  # chunks dropped from a step a layer found short (calibrated reservation)
    thrown_away_token_layers: int = 0  # tokens x layers those chunks had run (up to the short layer)
    num_faulted_steps: int = 0  # steps in which a layer ran short (retried or repaired)
    arrival_seconds: torch.Tensor | None = None
    first_token_seconds: torch.Tensor | None = None  # the end of the step that sampled its first token
    finish_seconds: torch.Tensor | None = None
    num_output_tokens: torch.Tensor | None = None  # (S,) int64 generated tokens of finished requests
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    prefix_copied_blocks: int = 0  # blocks straddling a hit's end, copied within a device (not costed)

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
        return {
            "policy": self.policy,
            "steps": self.num_steps,
            "modelled_seconds": self.seconds,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "finished": self.num_finished,
            "refused": self.num_refused,
            "evictions": self.num_evictions,
            "victim_sequences": self.num_victim_sequences,
            "recomputed_tokens": self.recomputed_tokens,
            "swapped_bytes": self.swapped_bytes,
            "retries": self.num_retries,
            "thrown_away_tokens": self.thrown_away_tokens,
            "thrown_away_seconds": self.thrown_away_seconds,
            "repairs": self.num_repairs,
            "thrown_away_token_layers": self.thrown_away_token_layers,
            "faulted_steps": self.num_faulted_steps,
            "freed_on_short_device_per_eviction": self.freed_per_eviction,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_copied_blocks": self.prefix_copied_blocks,
        }


class TraceFuture:
    """The FutureView (engine/victims.py) of a trace, for the offline policies: request ids are
    trace sequence ids, and a request runs one token a step from now to its end."""

    def __init__(self, trace: RoutingTrace, manager: KVCacheManager, shape: ModelShape):
        self.trace, self.manager, self.shape = trace, manager, shape
        lengths = torch.arange(int(trace.lengths.max()) + 1)  # (n,)
        self.lifetime = worst_case_lifetime_blocks_per_device(  # (n, D)
            lengths, shape.k_max, manager.block_size, self._map(lengths), manager.num_devices
        )
        self._held, self._reserved = {}, {}  # seq -> held(seq), reserved(seq)

    def _map(self, counts: torch.Tensor) -> torch.Tensor:
        return self.manager.placement.expert_devices.expand(counts.shape[0], -1, -1)  # (n, L, E) devices

    def held(self, seq: int) -> torch.Tensor:
        """(len + 1, D) blocks the sequence holds on each device after its first t tokens."""
        if seq not in self._held:
            counts = self.trace.row_counts(seq)  # (len + 1, L, E)
            self._held[seq] = blocks_held_per_device(
                counts, self.manager.block_size, self._map(counts), self.manager.num_devices
            )
        return self._held[seq]

    def reserved(self, seq: int) -> torch.Tensor:
        """(len, D): at the step appending token t, the blocks held before it plus the scheduler's
        worst-case reservation (capped, as the scheduler caps it, by the lifetime worst case)."""
        if seq not in self._reserved:
            counts, held, shape = self.trace.row_counts(seq)[:-1], self.held(seq)[:-1], self.shape
            step = worst_case_step_blocks_per_device(
                counts,
                torch.ones(counts.shape[0], dtype=torch.int64),
                shape.k_max,
                self.manager.block_size,
                self._map(counts),
                self.manager.num_devices,
            )  # (len, D)
            lifetime = self.lifetime[1 : counts.shape[0] + 1]
            self._reserved[seq] = held + step_need(step, lifetime, held)
        return self._reserved[seq]

    def future_block_steps(self, request: Request, device: int) -> int:
        return int(self.held(request.request_id)[request.num_computed_tokens + 1 :, device].sum())

    def fits_to_completion(self, request: Request, running) -> bool:
        # from the next step on, each has computed its num_tokens (a decode token, or the prefill)
        paths = [self.reserved(r.request_id)[r.num_tokens :] for r in (*running, request)]  # (g, D) each
        total = torch.nn.utils.rnn.pad_sequence(paths).sum(1)  # (g_max, D)
        return bool((total <= self.manager.blocks_per_device).all())


class TraceRunner:
    """One run of one policy over a trace (module docstring)."""

    def __init__(
        self,
        trace: RoutingTrace,
        device_of_expert: torch.Tensor,
        setup: RunnerSetup,
        policy: VictimPolicy | str,
        cost: CostModel,
        arrivals: torch.Tensor | None = None,
        follows: torch.Tensor | None = None,
    ):
        """arrivals: (S,) seconds at which each trace sequence arrives (None: all at once, before
        the first step); steps then take `cost`'s seconds and requests join the waiting line in
        arrival order once the clock has reached them. follows: (S,) int64, for a session's later
        turn the index of the turn before it (sim/traces.py's conversation_turns), -1 for the
        others; such a turn arrives arrivals[s] seconds (the user's think time) after that turn
        finished, and is refused with it."""
        if follows is not None:
            follows = torch.as_tensor(follows)
            S = trace.num_sequences
            if (
                follows.shape != (S,)
                or follows.dtype != torch.int64
                or bool((follows < -1).any())
                or bool((follows >= torch.arange(S)).any())
                or arrivals is None
            ):
                raise ValueError(
                    f"follows must be ({S},) int64, each -1 or the index of an earlier sequence, "
                    f"with arrivals (think times for the follow-ups); got shape "
                    f"{tuple(follows.shape)}, {follows.dtype}, arrivals given: {arrivals is not None}"
                )
        if arrivals is not None:
            arrivals = torch.as_tensor(arrivals, dtype=torch.float64).clone()  # follow-ups' are filled in
            if (
                arrivals.shape != (trace.num_sequences,)
                or not bool(torch.isfinite(arrivals).all())
                or bool((arrivals < 0).any())
                or cost is None
            ):
                raise ValueError(
                    f"arrivals must be ({trace.num_sequences},) finite seconds >= 0, one per trace "
                    f"sequence, with a cost model to advance the clock; got shape "
                    f"{tuple(arrivals.shape)} and cost={cost!r}"
                )
        self.trace, self.setup, self.cost = trace, setup, cost
        L, E, K = trace.num_layers, trace.num_experts, trace.k_max
        # the table names the devices: each of 0..its largest gets a pool of setup.blocks_per_device
        per_device = check_int("setup.blocks_per_device", setup.blocks_per_device, 1, MAX_BLOCKS)
        device_of_expert = check_device_table(
            device_of_expert,
            MAX_BLOCKS // per_device,
            L,
            E,
            every_layer=True,
            devices_meaning=f"devices 0 up to the largest named get setup.blocks_per_device={per_device} "
            f"blocks each, at most {number(MAX_BLOCKS)} in all",
        )
        num_devices = int(device_of_expert.max()) + 1
        lists_ids = setup.list_block_ids or setup.prefix_caching or setup.num_host_blocks
        # counting.py: the same counts, no ids, where nothing reads one
        manager_class = KVCacheManager if lists_ids else CountingKVCacheManager
        if setup.prefix_caching:
            manager_class = PrefixCachingKVCacheManager
        self.manager = manager_class(
            L,
            E,
            setup.block_size,
            blocks_per_device=[setup.blocks_per_device] * num_devices,
            device_of_expert=device_of_expert,
            initial_num_seqs=setup.max_num_seqs + 1,
        )
        top_k = trace.is_top_k  # every token used all K: top-k routing
        self.shape = ModelShape(K, K if top_k else 1, int(trace.lengths.max()) + 1)
        self.future = TraceFuture(trace, self.manager, self.shape)
        if isinstance(policy, str):
            if policy not in VICTIM_POLICIES:
                raise ValueError(f"policy={policy!r} is not one of {tuple(VICTIM_POLICIES)}")
            cls = VICTIM_POLICIES[policy]
            policy = cls(self.future) if issubclass(cls, OfflinePolicy) else cls()
        if setup.prefix_caching and isinstance(policy, OfflinePolicy):
            raise ValueError(
                f"policy={policy.name!r} reads a trace's future as if each request started from "
                "nothing, which a prefix hit breaks: use an online policy with prefix_caching"
            )
        self.policy = policy
        reservation = setup.reservation
        if reservation == "clairvoyant":
            if setup.prefix_caching or setup.num_host_blocks:
                raise ValueError(
                    "reservation='clairvoyant' reads each request's blocks as if it started from "
                    "nothing and never swapped: not with prefix_caching or num_host_blocks"
                )
            reservation = ClairvoyantReservation(self.future)
        config = SchedulerConfig(
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            admission=setup.admission,
            victim=policy,
            reservation=reservation,
            preemption_mode="swap" if setup.num_host_blocks else "recompute",
        )
        # the engine's Scheduler with the simulator's speed-ups, deciding the same (fast_scheduler.py)
        self.scheduler = make_scheduler(
            config, self.manager, self.shape, setup.num_host_blocks, FastScheduler
        )
        self.num_refused = 0
        self.num_retries = 0
        self.thrown_away_tokens = 0
        self.thrown_away_seconds = 0.0  # modelled time of the tries undone, and of the chunks dropped
        self.thrown_away_token_layers = 0
        self.num_faulted_steps = 0
        self.hot_load = 1.0  # of the step being appended (_hot_load)
        self.failed_fraction = 1.0
        self.arrivals = (
            torch.zeros(trace.num_sequences, dtype=torch.float64) if arrivals is None else arrivals
        )
        # not yet arrived: (arrival seconds, sequence, request), earliest first, ties by sequence
        self.pending: list[tuple[float, int, Request]] = []
        self.followers: dict[int, list[Request]] = {}  # sequence -> the turns arriving after it finishes
        prompts = trace.prompt_lens.tolist()
        lengths = trace.lengths.tolist()  # read once: each read of the property computes all of them
        before = [-1] * trace.num_sequences if follows is None else follows.tolist()
        self.think = self.arrivals.clone()  # a follow-up's arrival is known once the turn before finishes
        self.arrivals[torch.tensor(before) >= 0] = float("nan")
        refused = set()
        # whether a request fits alone depends on its length only (prompt + max_new_tokens - 1, over
        # rows placed by expert): each length that fits is checked once
        fitting = set()
        for s in range(trace.num_sequences):  # earlier turns first: a refused turn's follow-ups go too
            prompt = prompts[s]
            max_new_tokens = lengths[s] - prompt + 1  # the last sampled token is never stored
            try:
                if before[s] in refused:
                    raise ValueError("the turn before it was refused")
                if lengths[s] not in fitting:
                    self.scheduler.check_fits_alone(prompt, max_new_tokens)
                    fitting.add(lengths[s])
            except ValueError:
                self.num_refused += 1
                refused.add(s)
                continue
            request = Request(s, trace.tokens_of(s, 0, prompt), SamplingParams(max_new_tokens=max_new_tokens))
            if arrivals is None:
                self.scheduler.add_request(request)
            elif before[s] >= 0:
                self.followers.setdefault(before[s], []).append(request)
            else:
                self.pending.append((float(self.arrivals[s]), s, request))
        heapq.heapify(self.pending)

    def append(self, out) -> torch.Tensor:
        """The model's part of a step (blocks only, as PagedKVCache.append_kv allocates them); (L,)
        experts chosen per layer over the step's tokens, for the demand predictor. Under a
        reservation that retries, OutOfBlocksError at the first layer some device cannot serve
        (`_first_short_layer`); under one that repairs, the chunks scheduled last leave the step
        (`_repair`) until every layer fits, and the others' appends go on."""
        manager = self.manager
        reservation = self.scheduler.reservation
        while True:
            added = self._add_sequences(out.scheduled)
            rows, hits, per_layer, positions, decode_all = self._routed_rows(out.scheduled)
            short = (
                self._first_short_layer(rows, hits) if reservation.retries or reservation.repairs else None
            )
            if short is None:
                break
            layer, shortfall = short
            if reservation.retries:
                self.failed_fraction = (
                    layer + 1
                ) / manager.num_layers  # of the forward, run before the fault
                raise OutOfBlocksError(f"layer {layer} is short of blocks", shortfall)
            for seq in reversed(added):  # not held, as the engine's undo of the forward leaves them
                manager.free(seq)
            self._repair(out, layer, shortfall)
        if isinstance(
            manager, PrefixCachingKVCacheManager
        ):  # which chunks each block spans, as paged.py records them
            allocation = manager.allocate_slots(rows, hits)
            manager.prefix_cache.record_positions(allocation.slot_mapping, torch.cat(positions))
        elif isinstance(manager, CountingKVCacheManager) and decode_all:
            manager.grow_decode_rows(rows)  # the trace's rows (distinct, held), one token each
        elif isinstance(manager, CountingKVCacheManager):
            manager.grow_trace_rows(rows, hits)
        else:
            manager.grow_rows(rows, hits)
        return per_layer

    def _add_sequences(self, scheduled) -> list[int]:
        """The scheduled sequences the manager does not hold yet, added in ascending order (as
        append_kv adds them); returns them."""
        added = []
        for seq in sorted(item.request.request_id for item in scheduled):
            if not self.manager.holds(seq):
                self.manager.add_sequence(seq)
                added.append(seq)
        return added

    def _routed_rows(self, scheduled) -> tuple:
        """The rows the trace routes the scheduled tokens to: (rows (a,), tokens each (a,), (L,)
        experts chosen per layer, each slot's position where a prefix cache records them, whether
        every item is one decode token)."""
        manager = self.manager
        ids = [item.request.request_id for item in scheduled]
        seqs, starts, counts, slots = (
            torch.tensor(  # (m,) each
                [
                    (seq, item.request.num_computed_tokens, item.num_tokens, manager.seq_index(seq))
                    for seq, item in zip(ids, scheduled)
                ],
                dtype=torch.int64,
            )
            .reshape(-1, 4)
            .unbind(1)
        )
        decode = counts == 1  # distinct rows, one slot each: no counting needed
        cached = isinstance(manager, PrefixCachingKVCacheManager)  # each slot's position is recorded
        rows, per_layer, *positions = self.trace.decode_appends(
            seqs[decode], starts[decode], row_seqs=slots[decode], with_positions=cached
        )
        hits = torch.ones_like(rows)
        decode_all = bool(decode.all())
        if not decode_all:
            chunk = ~decode  # prefills and recomputes: rows of other sequences
            chunk_rows, chunk_hits, chunk_per_layer, *chunk_positions = self.trace.appends(
                seqs[chunk], starts[chunk], counts[chunk], row_seqs=slots[chunk], with_positions=cached
            )
            rows = torch.cat([rows, chunk_rows])
            hits = torch.cat([hits, chunk_hits])
            per_layer = per_layer + chunk_per_layer
            positions += chunk_positions
        self.hot_load = self._hot_load(rows, hits)
        return rows, hits, per_layer, positions, decode_all

    def _hot_load(self, rows: torch.Tensor, hits: torch.Tensor) -> float:
        """D x the busiest device's share of the step's (token, layer, expert) entries: 1 when the
        routing spreads them evenly (or D = 1), up to D when one device takes them all."""
        D = self.manager.num_devices
        if D == 1 or not rows.numel():
            return 1.0
        per_device = torch.zeros(D, dtype=torch.int64).index_add_(0, self.manager.device_of_rows(rows), hits)
        return D * float(per_device.max()) / max(1, int(per_device.sum()))

    def _first_short_layer(self, rows: torch.Tensor, hits: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """Where the engine's forward would find a device short, allocating layer by layer, each
        layer's rows at once: (the first layer some device cannot serve, the blocks (D,) it lacks
        there), or None."""
        manager = self.manager
        L = manager.num_layers
        E = manager.num_experts
        old = manager.row_tokens[rows]
        opened = ceil_div(old + hits, manager.block_size) - ceil_div(old, manager.block_size)  # (a,)
        per_layer = torch.zeros(L, manager.num_devices, dtype=torch.int64)
        per_layer.index_put_(
            ((rows // E) % L, manager.device_of_rows(rows)), opened, accumulate=True
        )  # (L, D)
        taken = per_layer.cumsum(0)  # (L, D)
        free = manager.num_free_blocks_per_device  # (D,)
        short = (taken > free).any(1).nonzero().squeeze(1)
        if not short.numel():
            return None
        layer = int(short[0])
        return layer, torch.clamp(taken[layer] - free, min=0)

    def _repair(self, out, layer: int, shortfall: torch.Tensor) -> None:
        """Scheduler.repair drops the chunk scheduled last; it had run layers 0..layer, thrown away:
        counted in token-layers and in modelled seconds (its share of those layers' compute)."""
        index = self.scheduler.chunk_to_drop(out)
        item = None if index is None else out.scheduled[index]
        start, n = (0, 0) if item is None else (item.request.num_computed_tokens, item.num_tokens)
        self.scheduler.repair(out, shortfall)  # RuntimeError where there is no chunk
        self.thrown_away_token_layers += n * (layer + 1)
        if self.cost is not None:
            chunk = float(self.cost.recompute_seconds(start + n) - self.cost.recompute_seconds(start))
            self.thrown_away_seconds += chunk * self.hot_load * (layer + 1) / self.manager.num_layers

    def _step(self, step: int):
        """Schedule and append one step: (SchedulerOutput, (L,) experts chosen per layer). Under a
        reservation policy that retries (optimistic) an append that runs short is undone with the
        scheduling before it (engine/undo.py, as LLMEngine.step does) and the step scheduled again
        as the policy's `retry` says (fewer admissions, or the missing blocks freed first). Under
        one that repairs (calibrated), `append` drops chunks from the step instead."""
        scheduler = self.scheduler
        if not scheduler.reservation.retries:
            out = scheduler.schedule(step)
            repairs = scheduler.num_repairs
            per_layer = self.append(out)
            self.num_faulted_steps += scheduler.num_repairs > repairs
            return out, per_layer
        retry = None
        while True:
            # a snapshot only where a try can fail: most steps' worst case fits, and copying every
            # table each step would cost more than the step
            before = Snapshot(scheduler) if retry is not None or scheduler.may_run_short() else None
            out = scheduler.schedule(step, retry)
            try:
                per_layer = self.append(out)
                self.num_faulted_steps += retry is not None
                return out, per_layer
            except OutOfBlocksError as error:
                if before is None:
                    raise RuntimeError(f"step {step} ran short although its worst case fit") from error
                before.restore()
                self.num_retries += 1
                self.thrown_away_tokens += out.num_scheduled_tokens
                if self.cost is not None:  # the layers run before the fault cost their time
                    self.thrown_away_seconds += self.step_seconds(out) * self.failed_fraction
                retry = scheduler.reservation.retry(out, error, retry)

    def step_seconds(self, out) -> float:
        """A step's fixed cost at its token count (CostModel.step_fixed_seconds: weights, and the
        collectives where several devices serve it), each decode token or prefill / recompute chunk
        over its context, times the hot device's load (`hot_load`: the cost model splits that work
        evenly, and the step waits for the busiest device), and its swaps (each direction half of a
        swap)."""
        cost = self.cost
        seconds = cost.step_fixed_seconds(out.num_scheduled_tokens)
        work = 0.0
        for item in out.scheduled:
            start, n = item.request.num_computed_tokens, item.num_tokens
            work += float(
                cost.decode_seconds(start)
                if n == 1 and start > 0
                else cost.recompute_seconds(start + n) - cost.recompute_seconds(start)
            )
        seconds += work * self.hot_load
        for copy in out.block_copies:
            if copy.direction != COPY:  # a prefix hit's copies stay within one device's memory
                seconds += float(cost.swap_seconds(copy.source.numel())) / 2
        return seconds

    def run(self, max_steps: int = 100_000, on_step=None) -> RunnerStats:
        """Step until every request finished (or max_steps); on_step(num_finished), if given, is
        called after each step (a progress bar)."""
        scheduler, manager = self.scheduler, self.manager
        block_bytes = self.setup.block_size * self.trace.kv_bytes_per_slot
        used, running, evictions, events, victims = [], [], [], [], set()
        S = self.trace.num_sequences
        first_token = [math.nan] * S  # a list while running: read and written per request each step
        finish = torch.full((S,), float("nan"), dtype=torch.float64)
        num_output = torch.zeros(S, dtype=torch.int64)
        seconds = 0.0
        finished_tokens = 0
        num_finished = 0
        swapped_blocks = 0
        copied_blocks = 0
        step = 0
        while (scheduler.has_unfinished or self.pending) and step < max_steps:
            if not scheduler.has_unfinished:  # idle: the clock jumps to the next arrival
                seconds = max(seconds, self.pending[0][0])
            while self.pending and self.pending[0][0] <= seconds:
                scheduler.add_request(heapq.heappop(self.pending)[2])
            thrown_before = self.thrown_away_seconds
            out, entries = self._step(step)
            seconds += self.thrown_away_seconds - thrown_before  # a retried step costs its failed tries too
            if not out.scheduled and not out.block_copies:
                raise RuntimeError(f"step {step}: nothing could be scheduled (as the engine would raise)")
            seconds += self.step_seconds(out) if self.cost is not None else 0.0
            swapped_blocks += sum(c.source.numel() for c in out.block_copies if c.direction != COPY)
            copied_blocks += sum(c.source.numel() for c in out.block_copies if c.direction == COPY)
            evictions += out.evictions
            events += [(step, request.request_id, kind) for kind, request in out.events]
            victims.update(request.request_id for request in out.preempted)
            running.append(len(scheduler.running))
            used.append(manager.blocks_per_device - manager.num_free_blocks_per_device)
            done = scheduler.update_from_output(out, self.sampled(out), entries)
            for item in out.scheduled:
                rid = item.request.request_id
                if item.samples and math.isnan(first_token[rid]):
                    first_token[rid] = seconds
            for request in done:
                finish[request.request_id] = seconds
                num_output[request.request_id] = len(request.output_token_ids)
                for follower in self.followers.pop(request.request_id, ()):
                    arrival = seconds + float(self.think[follower.request_id])
                    self.arrivals[follower.request_id] = arrival
                    heapq.heappush(self.pending, (arrival, follower.request_id, follower))
            finished_tokens += sum(len(r.output_token_ids) for r in done)
            num_finished += len(done)
            step += 1
            if on_step is not None:
                on_step(num_finished)
        if not scheduler.has_unfinished:
            scheduler.memory.assert_no_leak()
        return RunnerStats(
            self.policy.name,
            step,
            seconds,
            finished_tokens,
            num_finished,
            self.num_refused,
            scheduler.num_evictions,
            len(victims),
            scheduler.num_recomputed_tokens,
            swapped_blocks * block_bytes,
            scheduler.freed_on_short_device,
            torch.stack(used) if used else torch.zeros(0, manager.num_devices, dtype=torch.int64),
            torch.tensor(running),
            evictions,
            events,
            self.num_retries,
            self.thrown_away_tokens,
            self.thrown_away_seconds,
            scheduler.num_repairs,
            self.thrown_away_token_layers,
            self.num_faulted_steps,
            self.arrivals.clone(),
            torch.tensor(first_token, dtype=torch.float64),
            finish,
            num_output,
            manager.prefix_cache.stats.num_hit_tokens
            if isinstance(manager, PrefixCachingKVCacheManager)
            else 0,
            copied_blocks,
        )

    def sampled(self, out) -> dict[int, int]:
        """The token each scheduled request samples this step: the trace's next token (0 where it
        carries none; a prefill chunk's is never used)."""
        if self.trace.token_ids is None:
            return {item.request.request_id: 0 for item in out.scheduled}
        return {
            item.request.request_id: self.trace.tokens_of(
                item.request.request_id,
                item.request.num_computed_tokens + item.num_tokens,
                item.request.num_computed_tokens + item.num_tokens + 1,
            )[0]
            for item in out.scheduled
        }


def simulate(
    trace: RoutingTrace,
    device_of_expert: torch.Tensor,
    setup: RunnerSetup,
    policy,
    cost: CostModel,
    max_steps: int = 100_000,
) -> RunnerStats:
    return TraceRunner(trace, device_of_expert, setup, policy, cost).run(max_steps)


def memory_time_bound(trace: RoutingTrace, device_of_expert: torch.Tensor, setup: RunnerSetup) -> dict:
    """A lower bound on the steps any policy needs: the most, over devices, of the blocks each
    served sequence holds at each of its steps (prefill, then one per decode token) summed, over the
    pool; the longest sequence's steps; and all steps / max_num_seqs."""
    runner = TraceRunner(trace, device_of_expert, setup, "newest_first", cost=None)  # built, never run
    paths = [
        runner.future.held(r.request_id)[r.num_tokens :]  # (steps, D) from the prefill on
        for r in runner.scheduler.waiting
    ]  # the served: none has started
    block_steps = sum(path.sum(0) for path in paths)  # (D,)
    tokens = sum(path.shape[0] for path in paths)  # all steps, one generated token each
    steps = max(
        float((block_steps / runner.manager.blocks_per_device).max()),
        max((path.shape[0] for path in paths), default=0),
        tokens / setup.max_num_seqs,
    )
    return {"steps": steps, "finished_tokens": tokens, "tokens_per_step": tokens / steps}
