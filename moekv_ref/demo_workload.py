"""The demo's workload, and serving a workload on a fresh engine: what `python -m moekv_ref demo`
serves, and what notebook 04's widget and exercise serve too.

The demo's requests arrive over time (a Poisson process counted in engine steps) with widely varying
prompt and output lengths (engine/workload.py: make_workload); one of them is too large for the
demo's pool, so that the run shows a refusal.
"""

from __future__ import annotations

from .engine import LLMEngine, SchedulerConfig
from .engine.workload import WorkloadRequest, make_workload, run_workload
from .prompts import encode
from .sampling import SamplingParams


def demo_workload(
    num_requests: int = 20, arrival_rate: float | None = 0.5, seed: int = 0, with_oversized: bool = True
) -> list[WorkloadRequest]:
    """The demo's requests; with_oversized adds one whose worst case exceeds the demo pool."""
    workload = make_workload(
        num_requests, prompt_len=(16, 160), output_len=(16, 128), arrival_rate=arrival_rate, seed=seed
    )
    if with_oversized:
        prompt = (encode("# a very long request\n") * 20)[:300]
        workload.insert(
            len(workload) // 2,
            WorkloadRequest(
                workload[len(workload) // 2].arrival_step, prompt, SamplingParams(max_new_tokens=200, seed=99)
            ),
        )
    return workload


def serve_workload(
    model,
    workload,
    num_blocks: int,
    block_size: int = 16,
    preemption_mode: str = "recompute",
    admission: str = "predicted",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    on_step=None,
):
    """Serve `workload` on a fresh engine; returns (engine, WorkloadResult)."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        admission=admission,
        preemption_mode=preemption_mode,
    )
    engine = LLMEngine(model, num_blocks, block_size, config, record_history=True)  # for the figures
    return engine, run_workload(engine, workload, on_step)
