"""Expert parallelism on torch.distributed: experts spread over ranks, three placements of the
attention experts' KV caches, every byte that travels counted (costs.py prices them on hardware).

    comm.py, launcher.py     counted, timed collectives that name a failed rank; starting ranks
    dispatch.py, shard.py    a token sent once per destination rank; what a rank holds of the model
    kv_placements.py         kv_with_expert, kv_with_sequence, replicated_attention
    runner.py, programs.py   one rank's step; RunSpec, run_parallel, the one-process reference_run
    locality.py              placement of experts on ranks compared on real routing
    serving.py               the engine's scheduler on rank 0, each rank a device of its pool

The program that runs it under torchrun is apps/parallel_run.py (`torchrun -m moekv_ref.apps.parallel_run`).
"""

from .comm import CollectiveError, Communicator
from .kv_placements import KV_PLACEMENTS
from .launcher import WorkerFailed, launch

__all__ = ["KV_PLACEMENTS", "CollectiveError", "Communicator", "WorkerFailed", "launch"]
