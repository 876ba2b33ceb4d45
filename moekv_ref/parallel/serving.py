"""The serving engine driving the expert-parallel model: one scheduler, per-rank pools.

Rank 0 runs the engine's `Scheduler` (engine/scheduler.py) on integers and, every step, broadcasts
the step's plan to every rank: the flat batch (token, sequence, position of every scheduled token)
and the sequences whose blocks the scheduler freed (finished or preempted). Every rank frees them,
then runs `ParallelRunner.step` on its home sequences' tokens (sequence i's home is i % R); the
last-token logits come back to rank 0 (an all-to-all with rank 0 the only destination), which
samples; and each rank reports its pool to rank 0 in integers (free blocks; per sequence, blocks and
(layer, expert) tokens held).

What changes for the scheduler: memory is short *per rank*. A step's worst case is reserved on each
rank separately (`PerRank` vectors: under kv_with_expert the rows of the experts on rank r can take
blocks only from r's pool, at most min(k_max, experts of r) per token per layer; under the other
placements the home rank takes a sequence's whole worst case), and it fits only if it fits on every
rank. So a sequence can be refused or preempted because *one* rank is short while the others have
room. `PerRank` compares the way the scheduler's loop needs ("a > b" when any rank exceeds, "a <= b"
when every rank fits), so the scheduler's own loop runs unchanged over these vectors.

Admission is optimistic (admit whenever the next step fits; preempt by recompute when short): the
demand predictor predicts one pool's blocks, not each rank's. Swap preemption is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.demand import worst_case_lifetime_blocks, worst_case_step_blocks
from ..engine.memory import MemoryView, ModelShape
from ..engine.model_runner import flatten_batch
from ..engine.request import Request, RequestOutput
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..sampling import SamplingParams, sample_next
from .launcher import WorkerContext
from .programs import ModelSpec
from .runner import ParallelRunner


class PerRank:
    """Blocks on each of R ranks. `a > b`: some rank exceeds; `a <= b`: every rank fits. Adding an
    int adds it to every rank (the scheduler starts its reservation at 0)."""

    def __init__(self, values):
        self.values = torch.as_tensor(values, dtype=torch.int64).clone()

    def _other(self, other):
        return other.values if isinstance(other, PerRank) else torch.as_tensor(other, dtype=torch.int64)

    def __add__(self, other):
        return PerRank(self.values + self._other(other))

    __radd__ = __add__

    def __sub__(self, other):
        return PerRank(self.values - self._other(other))

    def __gt__(self, other):
        return bool((self.values > self._other(other)).any())

    def __le__(self, other):
        return bool((self.values <= self._other(other)).all())

    def __ge__(self, other):     # int <= PerRank: the int fits on every rank
        return bool((self.values >= self._other(other)).all())

    def __lt__(self, other):     # int > PerRank: the int exceeds some rank
        return bool((self.values < self._other(other)).any())

    def __repr__(self):
        return f"PerRank({self.values.tolist()})"


class RankPools:
    """What rank 0 knows of every rank's pool, in integers, from the ranks' reports after each step;
    answers the block manager's questions the scheduler asks (`num_blocks`, `num_free_blocks` as
    PerRank; `sequences`, `token_counts`, `free`). `free` counts the blocks as free at once and
    queues the sequence for the ranks, which free it before the next forward."""

    def __init__(self, world_size: int, num_blocks: int, num_layers: int, num_experts: int):
        self.world_size = world_size
        self.shape = (num_layers, num_experts)
        self._num_blocks = [num_blocks] * world_size
        self._free = [num_blocks] * world_size
        self._held: list[dict[int, tuple[int, torch.Tensor]]] = [{} for _ in range(world_size)]   # seq -> (blocks, (L, E))
        self.pending_frees: list[int] = []

    @property
    def num_blocks(self) -> PerRank:
        return PerRank(self._num_blocks)

    @property
    def num_free_blocks(self) -> PerRank:
        return PerRank(self._free)

    @property
    def sequences(self) -> list[int]:
        return sorted({seq for held in self._held for seq, (blocks, _) in held.items() if blocks})

    def token_counts(self, seq_ids) -> torch.Tensor:
        """(m, L, E) tokens each sequence holds, over every rank."""
        out = torch.zeros((len(seq_ids),) + self.shape, dtype=torch.int64)
        for i, seq in enumerate(seq_ids):
            for held in self._held:
                if int(seq) in held:
                    out[i] += held[int(seq)][1]
        return out

    def blocks_held(self, seq_id: int) -> list[int]:
        return [held[int(seq_id)][0] if int(seq_id) in held else 0 for held in self._held]

    def free(self, seq_id: int) -> None:
        seq_id = int(seq_id)
        if seq_id not in self.sequences:
            raise KeyError(f"sequence {seq_id} holds no blocks on any rank")
        for rank, held in enumerate(self._held):
            self._free[rank] += held.pop(seq_id, (0, None))[0]
        self.pending_frees.append(seq_id)

    def update(self, rank: int, free_blocks: int, held: dict[int, tuple[int, torch.Tensor]]) -> None:
        """A rank's report: its free blocks and, per sequence it holds, (blocks, (L, E) tokens)."""
        self._free[rank] = free_blocks
        self._held[rank] = dict(held)


class RankMemoryView(MemoryView):
    """MemoryView over RankPools: blocks held summed over ranks."""

    def num_blocks_held(self, seq_id: int) -> int:
        return sum(self._manager.blocks_held(seq_id))


class RankAwareScheduler(Scheduler):
    """The engine's scheduler with each step's worst case reserved per rank (see the module
    docstring). attention_ranks (L, E): the rank of every attention expert."""

    def __init__(self, config: SchedulerConfig, pools: RankPools, shape: ModelShape, kv_placement: str,
                 attention_ranks):
        if config.preemption_mode != "recompute":
            raise ValueError("the parallel engine preempts by recompute only (no per-rank swap space)")
        if config.admission not in (None, "optimistic"):
            raise ValueError(f"admission={config.admission!r}: the parallel engine admits optimistically "
                             f"(the demand predictor predicts one pool, not each rank's)")
        super().__init__(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                         admission="optimistic", victim=config.victim), pools, shape)
        self.memory = RankMemoryView(pools, shape)
        self.kv_placement = kv_placement
        self.attention_ranks = torch.as_tensor(attention_ranks, dtype=torch.int64)   # (L, E)
        self.world_size = pools.world_size

    def _experts_of(self, rank: int) -> torch.Tensor:
        """(L, E/R) the experts of each layer on this rank (placement.py gives every rank E/R)."""
        return torch.stack([(row == rank).nonzero().squeeze(1) for row in self.attention_ranks])

    def step_blocks(self, request: Request, num_tokens: int) -> PerRank:
        shape = self.shape
        counts = self.memory.token_counts([request.request_id])                     # (1, L, E)
        total = request.num_computed_tokens + num_tokens
        per_rank = []
        for rank in range(self.world_size):
            if self.kv_placement == "kv_with_expert":
                experts = self._experts_of(rank)                                    # (L, E_r)
                mine = torch.gather(counts[0], 1, experts)[None]                    # (1, L, E_r)
                k_max = min(shape.k_max, experts.shape[1])
                step = int(worst_case_step_blocks(mine, torch.tensor([num_tokens]), k_max, shape.block_size)[0])
                lifetime = worst_case_lifetime_blocks(total, shape.num_layers, experts.shape[1], k_max, shape.block_size)
            elif rank == request.request_id % self.world_size:
                step = int(worst_case_step_blocks(counts, torch.tensor([num_tokens]), shape.k_max, shape.block_size)[0])
                lifetime = worst_case_lifetime_blocks(total, shape.num_layers, shape.num_experts, shape.k_max,
                                                      shape.block_size)
            else:
                per_rank.append(0)
                continue
            held = self.memory._manager.blocks_held(request.request_id)[rank]
            per_rank.append(max(0, min(step, lifetime - held)))
        return PerRank(per_rank)

    def step_blocks_many(self, requests: list[Request], num_tokens: list[int]) -> list:
        return [self.step_blocks(r, n) for r, n in zip(requests, num_tokens)]   # needs per rank

    def check_fits_alone(self, prompt_len: int, max_new_tokens: int) -> None:
        shape, num_tokens = self.shape, prompt_len + max_new_tokens - 1
        pool = int(self.memory.num_blocks.values.min())
        if self.kv_placement == "kv_with_expert":
            per_rank = self.attention_ranks.shape[1] // self.world_size
            k = min(shape.k_max, per_rank)
            worst = worst_case_lifetime_blocks(num_tokens, shape.num_layers, per_rank, k, shape.block_size)
        else:
            worst = worst_case_lifetime_blocks(num_tokens, shape.num_layers, shape.num_experts, shape.k_max,
                                               shape.block_size)
        if worst > pool:
            raise ValueError(f"request of {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} may need "
                             f"{worst} blocks on one rank under {self.kv_placement}; each rank's pool has {pool}")


@dataclass(frozen=True)
class ServeSpec:
    model: ModelSpec
    kv_placement: str
    attention_ranks: tuple
    ffn_ranks: tuple
    prompts: tuple
    max_new_tokens: tuple
    num_blocks: int                 # per rank
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256


@dataclass
class ServeResult:
    tokens: list = field(default_factory=list)          # generated ids, per prompt
    free_blocks: list = field(default_factory=list)     # per step: free blocks per rank when scheduled
    events: list = field(default_factory=list)          # (step, kind, request id)
    num_preemptions: int = 0


def serve(context: WorkerContext, spec: ServeSpec) -> ServeResult | None:
    """Worker: rank 0 schedules and samples, every rank runs the model. Greedy sampling."""
    comm, rank, R = context.comm, context.rank, context.world_size
    model = spec.model.build().to(context.device)
    config = model.config
    runner = ParallelRunner(model, comm, spec.kv_placement, spec.attention_ranks, spec.ffn_ranks,
                            spec.num_blocks, spec.block_size)
    del model
    L, E = config.num_hidden_layers, config.num_attention_experts
    scheduler = requests = pools = None
    result = ServeResult()
    if rank == 0:
        pools = RankPools(R, spec.num_blocks, L, E)
        scheduler = RankAwareScheduler(SchedulerConfig(spec.max_num_seqs, spec.max_num_batched_tokens), pools,
                                       ModelShape.from_config(config, spec.block_size), spec.kv_placement,
                                       spec.attention_ranks)
        requests = []
        for i, (prompt, n) in enumerate(zip(spec.prompts, spec.max_new_tokens)):
            scheduler.check_fits_alone(len(prompt), n)
            requests.append(Request(i, list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0)))
            scheduler.add_request(requests[-1])
    step = 0
    while True:
        # ---- rank 0 decides; everyone learns the plan
        header = torch.zeros(3, dtype=torch.int64)
        if rank == 0:
            if not scheduler.has_unfinished:
                header[2] = 1
            else:
                result.free_blocks.append(pools.num_free_blocks.values.tolist())
                decision = scheduler.schedule(step)
                result.events += [(step, kind, r.request_id) for kind, r in decision.events]
                if not decision.scheduled:
                    raise RuntimeError(f"step {step}: nothing could be scheduled")
                batch = flatten_batch(decision.scheduled)
                frees, pools.pending_frees = pools.pending_frees, []
                body = torch.tensor(batch.token_ids + batch.seq_ids + batch.positions + frees, dtype=torch.int64)
                header[0], header[1] = len(batch.token_ids), len(frees)
        comm.begin_step(step)
        comm.broadcast(header, 0, "plan")
        if int(header[2]):
            break
        N, F = int(header[0]), int(header[1])
        if rank != 0:
            body = torch.empty(3 * N + F, dtype=torch.int64)
        comm.broadcast(body, 0, "plan")
        tokens, seq_ids, positions, frees = body[:N], body[N:2 * N], body[2 * N:3 * N], body[3 * N:]
        for seq_id in frees.tolist():
            runner.free(seq_id)
        # ---- every rank runs its home sequences' tokens
        mine = (seq_ids % R) == rank
        device = context.device
        logits = runner.step(step, tokens[mine].to(device), seq_ids[mine].to(device), positions[mine].to(device))
        last = torch.ones(int(mine.sum()), dtype=torch.bool)                             # last token of each seq
        my_seqs = seq_ids[mine]
        if my_seqs.numel() > 1:
            last[:-1] = my_seqs[1:] != my_seqs[:-1]
        rows = torch.cat([my_seqs[last, None].to(logits), logits[last.to(logits.device)]], dim=1)   # (m_r, 1 + V)
        send = [rows.shape[0]] + [0] * (R - 1)
        gathered, _ = comm.all_to_all(rows, send, "logits")
        # ---- every rank reports its pool, in integers
        manager = runner.pool.manager
        held = manager.sequences
        report = torch.zeros(len(held) + 1, 2 + L * E, dtype=torch.int64)
        report[0, :2] = torch.tensor([-1, manager.num_free_blocks])
        for i, seq_id in enumerate(held):
            report[i + 1, 0], report[i + 1, 1] = seq_id, manager.blocks_of_sequence(seq_id).numel()
            report[i + 1, 2:] = manager.token_counts([seq_id])[0].flatten()
        reports, counts = comm.all_to_all(report, [report.shape[0]] + [0] * (R - 1), "pool_report")
        if rank == 0:
            start = 0
            for source, n in enumerate(counts):
                part = reports[start:start + n]
                start += n
                pools.update(source, int(part[0, 1]), {int(r[0]): (int(r[1]), r[2:].view(L, E)) for r in part[1:]})
            by_seq = {int(r[0]): r[1:] for r in gathered.cpu()}
            sampled = {item.request.request_id: sample_next(by_seq[item.request.request_id], item.request.sampling_params,
                                                            item.request.generator)
                       for item in decision.scheduled if item.samples}
            for request in scheduler.update_from_output(decision, sampled):
                result.events.append((step, "finished", request.request_id))
        step += 1
    if rank != 0:
        return None
    result.tokens = [RequestOutput.from_request(r).token_ids for r in requests]
    result.num_preemptions = scheduler.num_preemptions
    return result


def serve_specs(context: WorkerContext, specs: list[ServeSpec]) -> list[ServeResult | None]:
    """Worker: several serving runs in one process group (starting processes is the slow part)."""
    results = []
    for spec in specs:
        context.comm.reset()
        results.append(serve(context, spec))
    return results
