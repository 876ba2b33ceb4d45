"""Expert parallelism on torch.distributed: the experts spread over ranks, three placements of the
attention experts' KV caches, every byte that travels counted. What a step moves and costs on
real hardware is projected in moekv_ref/costs.py.

    comm.py           Communicator: all_to_all_single / all_gather / broadcast with byte counters per
                      rank and step, timing, and errors that name the rank and collective that failed
    launcher.py       launch(function, world_size, args): spawn ranks from Python (gloo or NCCL); the
                      start-up and collective timeouts; test-only fault injection (MOEKV_FAULT)
    dispatch.py       DispatchPlan: a token's hidden state once per destination rank; dispatch, combine
    shard.py          RankShard: the experts a rank holds, and the replicated small parts
    kv_placements.py  kv_with_expert, kv_with_sequence, replicated_attention
    runner.py         ParallelRunner: one rank's step (attention placement + expert-parallel FFN)
    programs.py       RunSpec, run_specs (the worker), run_parallel, reference_run
    locality.py       placement of experts on ranks compared on real routing
    serving.py        the serving engine's scheduler on rank 0, each rank a device of its pool, plans broadcast
    __main__.py       `torchrun --nproc_per_node=N -m moekv_ref.parallel ...`, the program in
                      apps/parallel_run.py; the context sweep it and `bench parallel` measure is in
                      apps/parallel_measure.py, the values they accept in apps/parallel_options.py
"""

from .comm import CollectiveError, Communicator
from .kv_placements import KV_PLACEMENTS
from .launcher import WorkerFailed, launch

__all__ = ["KV_PLACEMENTS", "CollectiveError", "Communicator", "WorkerFailed", "launch"]
