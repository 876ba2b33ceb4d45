"""What the ranks run (`run_specs`, launched by `run_parallel`), and the single-process run they
must equal (`reference_run`).

A `RunSpec` is one run: the model, the KV placement, the rank of every expert, the prompts and the
tokens fed at each decode step (fixed in advance, so that both runs see the same inputs whatever
rounding does to the logits). Sequence i's home rank is i % world_size. Many specs share one
process group, as starting processes is the slow part.

    step 0          every sequence's whole prompt (a ragged prefill)
    step s >= 1     one token per sequence: decode_tokens[i][s - 1] at position len(prompt_i) + s - 1
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..cache import PagedKVCache
from ..checkpoint import COMPUTE_DTYPES
from ..config import ModelConfig
from ..model import MoEKVTransformer
from .launcher import DEFAULT_START_TIMEOUT_S, DEFAULT_TIMEOUT_S, FAULT_KEY, WorkerContext, launch
from .runner import ParallelRunner


@dataclass(frozen=True)
class ModelSpec:
    """A random model of `config` (ModelConfig.to_dict()), seeded, its attention routers scaled by
    router_scale (decisive, as a trained model's are). router_skew > 0 biases every attention router
    from +skew (expert 0) down to -skew, to load low experts."""

    config: dict
    seed: int = 0
    dtype: str = "float32"
    router_scale: float = 4.0
    router_skew: float = 0.0

    def build(self) -> MoEKVTransformer:
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {tuple(COMPUTE_DTYPES)}")
        torch.manual_seed(self.seed)
        model = MoEKVTransformer(ModelConfig.from_dict(self.config))
        with torch.no_grad():
            for block in model.blocks:
                block.attention.router.weight.mul_(self.router_scale)
        model = model.to(COMPUTE_DTYPES[self.dtype])
        skew = self.router_skew
        for router in (block.attention.router for block in model.blocks) if skew else ():
            bias = torch.linspace(skew, -skew, router.out_features, dtype=router.weight.dtype)
            router.register_parameter("bias", torch.nn.Parameter(bias))
        return model.eval()


@dataclass(frozen=True)
class RunSpec:
    model: ModelSpec
    kv_placement: str
    attention_ranks: tuple  # (L, E) nested tuples of ints
    ffn_ranks: tuple  # (L, E_ffn)
    prompts: tuple  # tuples of token ids
    decode_tokens: tuple  # per sequence, the token fed at each decode step
    num_blocks: int = 512
    block_size: int = 16
    record_logits: bool = True
    label: str = ""
    # fault injection (MOEKV_FAULT, launcher.Fault): rank fail_rank dies, hangs or stops at fail_step
    fail_rank: int = -1
    fail_step: int = -1
    fail_mode: str = ""

    @property
    def num_decode_steps(self) -> int:
        return len(self.decode_tokens[0]) if self.decode_tokens else 0


def step_inputs(spec: RunSpec, step: int, seqs: list[int]):
    """tokens, seq_ids, positions (flat, ragged) of the given sequences at a step of the schedule."""
    rows = []  # (token, sequence, position)
    for i in seqs:
        prompt = spec.prompts[i]
        if step == 0:
            rows += [(token, i, position) for position, token in enumerate(prompt)]
        else:
            rows.append((spec.decode_tokens[i][step - 1], i, len(prompt) + step - 1))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).T.contiguous().unbind()


def split_logits(logits: torch.Tensor, seq_ids: torch.Tensor, step: int) -> dict:
    return {(step, int(s)): logits[seq_ids == s] for s in seq_ids.unique().tolist()}


@dataclass
class RankResult:
    rank: int
    logits: dict = field(default_factory=dict)  # (step, seq) -> (tokens, V)
    bytes: dict = field(default_factory=dict)  # step -> {category: bytes sent to peers}
    comm_seconds: dict = field(default_factory=dict)  # step -> seconds inside collectives
    step_seconds: dict = field(default_factory=dict)  # step -> seconds of the whole step
    traffic: dict = field(default_factory=dict)  # step -> {count name: int}
    pool: dict = field(default_factory=dict)  # step -> pool_usage() after the step
    weight_bytes: dict = field(default_factory=dict)
    kv_tokens_per_expert: list = field(default_factory=list)  # (L, E) tokens this rank's pool holds


def run_specs(context: WorkerContext, specs: list[RunSpec]) -> list[RankResult]:
    """Worker: run each spec's schedule on this rank; the launcher starts this on every rank."""
    results = []
    for spec in specs:
        comm = context.comm
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
        mine = [i for i in range(len(spec.prompts)) if i % context.world_size == context.rank]
        result = RankResult(context.rank, weight_bytes=runner.shard.weight_bytes())
        for step in range(spec.num_decode_steps + 1):
            if (context.rank, step) == (spec.fail_rank, spec.fail_step):
                inject_failure(spec.fail_mode, context.comm.store)
            tokens, seq_ids, positions = (t.to(context.device) for t in step_inputs(spec, step, mine))
            logits = runner.step(step, tokens, seq_ids, positions)
            if spec.record_logits:
                result.logits.update(split_logits(logits.cpu(), seq_ids.cpu(), step))
            result.pool[step] = runner.pool_usage()
        result.bytes = comm.bytes_by_step()
        result.comm_seconds = comm.seconds_by_step()
        result.step_seconds = dict(runner.step_seconds)
        result.traffic = {step: dict(counts) for step, counts in runner.traffic.items()}
        held = runner.cache.manager.token_counts(range(len(spec.prompts)))  # (S, L, E)
        result.kv_tokens_per_expert = held.sum(0).tolist()
        results.append(result)
    return results


def inject_failure(mode: str, store=None) -> None:
    """Die, hang or stop now, noting the time in the store and on stderr first (the launcher reports how
    long after it every rank was gone; under torchrun, stderr is all that outlives it)."""
    if mode not in ("die", "hang", "stop"):
        raise ValueError(f"fail_mode={mode!r} is not one of ('die', 'hang', 'stop')")
    now = time.time()
    if store is not None:
        store.set(FAULT_KEY, repr(now))
    print(f"injected fault: {mode} at wall-clock time {now:.3f}", file=sys.stderr, flush=True)
    if mode == "die":
        os._exit(3)
    if mode == "stop":  # stopped: only SIGKILL ends it (a SIGTERM waits, pending, for a SIGCONT)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)  # hang: only a signal (the launcher's kill, torchrun's SIGTERM) ends it


def run_parallel(
    specs: list[RunSpec],
    world_size: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
) -> list[list[RankResult]]:
    """Launch run_specs on world_size ranks: for each spec, the list of its ranks' results."""
    per_rank = launch(
        run_specs, world_size, (list(specs),), timeout_s=timeout_s, start_timeout_s=start_timeout_s
    )
    return [[per_rank[rank][i] for rank in range(world_size)] for i in range(len(specs))]


def merged_logits(results: list[RankResult]) -> dict:
    """Every (step, seq) logits, from whichever rank is the sequence's home."""
    return {key: rows for result in results for key, rows in result.logits.items()}


@torch.no_grad()
def reference_run(spec: RunSpec) -> tuple[dict, list]:
    """The same schedule in one process (forward_cached, one paged cache): the (step, seq) logits
    and the tokens the cache holds per (layer, expert) at the end."""
    model = spec.model.build()
    cache = PagedKVCache.for_model(model, block_size=spec.block_size, num_blocks=spec.num_blocks * 8)
    everyone = list(range(len(spec.prompts)))
    out = {}
    for step in range(spec.num_decode_steps + 1):
        tokens, seq_ids, positions = step_inputs(spec, step, everyone)
        logits = model.forward_cached(tokens, seq_ids, positions, cache).logits
        out.update(split_logits(logits, seq_ids, step))
    return out, cache.token_counts(everyone).sum(0).tolist()


def max_difference(parallel: dict, reference: dict) -> float:
    if parallel.keys() != reference.keys():
        raise ValueError(
            f"the runs cover different (step, sequence) pairs: {sorted(set(parallel) ^ set(reference))[:5]}"
        )
    return max(float((parallel[key] - reference[key]).abs().max()) for key in reference)


def _summed_over_ranks(per_rank: list[dict], step: int) -> dict[str, int]:
    total = Counter()  # update, unlike +, keeps the zero counts
    for counts in per_rank:
        total.update(counts.get(step, {}))
    return dict(total)


def total_bytes(results: list[RankResult], step: int) -> dict[str, int]:
    """Bytes sent to peers at one step, per category, summed over ranks."""
    return _summed_over_ranks([result.bytes for result in results], step)


def total_traffic(results: list[RankResult], step: int) -> dict[str, int]:
    """The runner's counts (tokens dispatched, rows sent, ...) at one step, summed over ranks."""
    return _summed_over_ranks([result.traffic for result in results], step)
