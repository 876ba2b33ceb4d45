"""The serving engine driving the expert-parallel model: one scheduler, the ranks as devices of one pool.

Rank 0 runs the engine's `Scheduler` over a `KVCacheManager` mirroring every rank's pool (block
accounting only). Each step rank 0 broadcasts the plan (the flat batch, and the sequences whose
blocks went back); every rank frees those, runs its home sequences' tokens (sequence i's home is
i % R), sends its last-token logits to rank 0, which samples, and reports its pool in integers, for
rank 0 to check its mirror against (`follow_ranks`): a drift fails at the step it happens.

A row lives on its expert's rank under kv_with_expert, else on its sequence's home rank. A step's
worst case is reserved on each rank separately, so a sequence can be refused or preempted because
*one* rank is short. Admission is optimistic and preemption by recompute only (ServeSpec says why).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..cache.kv_cache_manager import KVCacheManager
from ..engine.memory import ModelShape
from ..engine.model_runner import flatten_batch
from ..engine.request import Request, RequestOutput
from ..engine.scheduler_config import SchedulerConfig
from ..engine.scheduler_factory import make_scheduler
from ..sampling import SamplingParams, sample_rows
from .launcher import WorkerContext
from .programs import ModelSpec
from .runner import ParallelRunner


@dataclass(frozen=True)
class ServeSpec:
    model: ModelSpec
    kv_placement: str
    attention_ranks: tuple
    ffn_ranks: tuple
    prompts: tuple
    max_new_tokens: tuple
    num_blocks: int  # per rank
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    admission: str = "optimistic"  # the only one: the demand predictor predicts one pool
    preemption_mode: str = "recompute"  # the only one: the ranks keep no swap space

    def __post_init__(self):
        if self.admission != "optimistic":
            raise ValueError(
                f"admission={self.admission!r}: the parallel engine admits 'optimistic' only "
                f"(the demand predictor predicts one pool's blocks, not each rank's)"
            )
        if self.preemption_mode != "recompute":
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r}: the parallel engine preempts by "
                f"'recompute' only (the ranks keep no swap space)"
            )


@dataclass
class ServeResult:
    tokens: list = field(default_factory=list)  # generated ids, per prompt
    free_blocks: list = field(default_factory=list)  # per step: free blocks per rank when scheduled (R,)
    events: list = field(default_factory=list)  # (step, kind, request id)
    num_preemptions: int = 0


def follow_ranks(mirror: KVCacheManager, reports: list[torch.Tensor]) -> set[int]:
    """Append the tokens each row gained on the ranks to rank 0's mirror, and check every device's
    free blocks. reports[r]: (1 + h, 1 + L * E) int64, [-1, free blocks, ...], then per sequence r
    holds [id, its (L, E) tokens on r]. Returns the sequences the ranks hold."""
    L, E = mirror.num_layers, mirror.num_experts
    rows = torch.cat([report[1:] for report in reports])  # a row lives on one rank: sum over ranks
    ids, which = rows[:, 0].unique(return_inverse=True)
    tokens = torch.zeros(len(ids), L * E, dtype=torch.int64).index_add_(0, which, rows[:, 1:])
    seq_ids = ids.tolist()
    for seq_id in seq_ids:
        if not mirror.holds(seq_id):
            mirror.add_sequence(seq_id)
    if seq_ids:
        gained = tokens.view(-1, L, E) - mirror.token_counts(seq_ids)  # (m, L, E)
        if (gained < 0).any():
            raise RuntimeError(
                f"rank 0's mirror of the pools drifted: rows of sequences "
                f"{[s for s, g in zip(seq_ids, gained) if (g < 0).any()]} hold fewer tokens on the ranks"
            )
        grown = mirror.index.sequence_rows(torch.tensor([mirror.seq_index(s) for s in seq_ids]))  # (m, L*E)
        mirror.grow_rows(grown.reshape(-1), gained.reshape(-1))
    reported = torch.stack([report[0, 1] for report in reports])  # (R,)
    if not torch.equal(reported, mirror.num_free_blocks_per_device):
        raise RuntimeError(
            f"rank 0's mirror of the pools drifted: the ranks report {reported.tolist()} free "
            f"blocks, the mirror counts {mirror.num_free_blocks_per_device.tolist()}"
        )
    return set(seq_ids)


def serve(context: WorkerContext, spec: ServeSpec) -> ServeResult | None:
    """Worker: rank 0 schedules and samples, every rank runs the model. Greedy sampling."""
    comm, rank, R = context.comm, context.rank, context.world_size
    comm.reset()
    runner = ParallelRunner(
        spec.model.build().to(context.device),
        comm,
        spec.kv_placement,
        spec.attention_ranks,
        spec.ffn_ranks,
        spec.num_blocks,
        spec.block_size,
    )
    config = runner.shard.config
    L, E = config.num_hidden_layers, config.num_attention_experts
    scheduler = requests = mirror = None
    on_ranks: set[int] = set()  # the sequences the ranks hold, from their last reports
    result = ServeResult()
    if rank == 0:
        by_expert = spec.kv_placement == "kv_with_expert"
        mirror = KVCacheManager(
            L,
            E,
            spec.block_size,
            blocks_per_device=[spec.num_blocks] * R,
            device_of_expert=spec.attention_ranks if by_expert else None,
            home_devices=not by_expert,
        )
        scheduler = make_scheduler(
            SchedulerConfig(
                spec.max_num_seqs,
                spec.max_num_batched_tokens,
                admission=spec.admission,
                preemption_mode=spec.preemption_mode,
            ),
            mirror,
            ModelShape.from_config(config),
        )
        requests = []
        for i, (prompt, n) in enumerate(zip(spec.prompts, spec.max_new_tokens)):
            scheduler.check_fits_alone(len(prompt), n, request_id=i)
            requests.append(Request(i, list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0)))
            scheduler.add_request(requests[-1])
    for step in itertools.count():
        # ---- rank 0 decides; everyone learns the plan
        header = torch.zeros(3, dtype=torch.int64)
        if rank == 0 and not scheduler.has_unfinished:
            header[2] = 1
        elif rank == 0:
            result.free_blocks.append(mirror.num_free_blocks_per_device.tolist())
            decision = scheduler.schedule(step)
            result.events += [(step, kind, r.request_id) for kind, r in decision.events]
            if not decision.scheduled:
                raise RuntimeError(f"step {step}: nothing could be scheduled")
            batch = flatten_batch(decision.scheduled)
            frees = sorted(on_ranks - set(mirror.sequences))  # finished or preempted since
            body = torch.tensor(batch.token_ids + batch.seq_ids + batch.positions + frees, dtype=torch.int64)
            header[0], header[1] = len(batch.token_ids), len(frees)
        comm.start_step(step)
        comm.broadcast(header, 0, "plan")
        if int(header[2]):
            break
        N, F = int(header[0]), int(header[1])
        if rank != 0:
            body = torch.empty(3 * N + F, dtype=torch.int64)
        comm.broadcast(body, 0, "plan")
        tokens, seq_ids, positions, frees = body[:N], body[N : 2 * N], body[2 * N : 3 * N], body[3 * N :]
        for seq_id in frees.tolist():
            if runner.cache.manager.holds(seq_id):  # a rank may hold none of it
                runner.cache.free(seq_id)
        # ---- every rank runs its home sequences' tokens
        mine = (seq_ids % R) == rank
        logits = runner.step(step, *(t[mine].to(context.device) for t in (tokens, seq_ids, positions)))
        my_seqs = seq_ids[mine]
        last = torch.ones_like(my_seqs, dtype=torch.bool)  # last token of each seq
        last[:-1] = my_seqs[1:] != my_seqs[:-1]
        rows = torch.cat(
            [my_seqs[last, None].to(logits), logits[last.to(logits.device)]], dim=1
        )  # (m_r, 1 + V)
        gathered, _ = comm.all_to_all(rows, [rows.shape[0]] + [0] * (R - 1), "logits")  # to rank 0
        # ---- every rank reports its pool, in integers: free blocks, each sequence's (L, E) tokens
        manager = runner.cache.manager
        held = manager.sequences
        report = torch.zeros(len(held) + 1, 1 + L * E, dtype=torch.int64)
        report[0, :2] = torch.tensor([-1, manager.num_free_blocks])
        report[1:, 0] = torch.tensor(held, dtype=torch.int64)
        report[1:, 1:] = manager.token_counts(held).flatten(1)
        reports, counts = comm.all_to_all(report, [report.shape[0]] + [0] * (R - 1), "pool_report")
        if rank == 0:
            on_ranks = follow_ranks(mirror, list(reports.cpu().split(counts)))
            by_seq = {int(r[0]): r[1:] for r in gathered.cpu()}
            sampling = [item.request for item in decision.scheduled if item.samples]
            chosen = (
                []
                if not sampling
                else sample_rows(
                    torch.stack([by_seq[r.request_id] for r in sampling]),
                    [r.sampling_params for r in sampling],
                    [r.generator for r in sampling],
                )
            )
            sampled = {r.request_id: t for r, t in zip(sampling, chosen)}
            for request in scheduler.update_from_output(decision, sampled):
                result.events.append((step, "finished", request.request_id))
    if rank != 0:
        return None
    result.tokens = [RequestOutput.from_request(r).token_ids for r in requests]
    result.num_preemptions = scheduler.num_preemptions
    return result


def serve_specs(context: WorkerContext, specs: list[ServeSpec]) -> list[ServeResult | None]:
    """Worker: several serving runs in one process group (starting processes is the slow part)."""
    return [serve(context, spec) for spec in specs]
