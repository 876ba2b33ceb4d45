"""`torchrun --nproc_per_node=N -m moekv_ref.parallel [options]`: one run of the context sweep's model.

Every rank prefills one sequence of --context tokens per rank and decodes --decode-steps tokens under
the chosen KV placement and expert placement, then rank 0 prints the bytes per decode step (summed
over ranks), each rank's pool and the time split. torchrun's own options (--nnodes, --rdzv-endpoint,
...) run it across machines; NCCL is used when CUDA is available, gloo otherwise. Without torchrun
(no RANK in the environment) it starts --nproc ranks itself through the Python launcher.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from ..placement import PLACEMENTS
from .comm import Communicator
from .kv_placements import KV_PLACEMENTS
from .launcher import WorkerContext, default_backend
from .measure import bytes_table, context_sweep_specs
from .programs import run_parallel, run_specs


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m moekv_ref.parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--placement", choices=KV_PLACEMENTS, default="kv_with_expert", help="where the K/V lives")
    parser.add_argument("--expert-placement", choices=[p for p in PLACEMENTS if p != "coactivation"],
                        default="round_robin", help="which rank holds which expert")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds a collective may wait on a peer")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start without torchrun")
    return parser.parse_args(argv)


def report(spec, results) -> None:
    row = bytes_table(spec, results)
    print(f"{row['kv_placement']}, context {row['context']}, {row['world_size']} ranks: "
          f"{row['bytes_per_decode_step']:.0f} bytes per decode step (attention {row['attention_bytes']:.0f}, "
          f"FFN {row['ffn_bytes']:.0f}, split sizes {row['split_size_bytes']:.0f}); "
          f"step {row['decode_step_ms']:.1f} ms of which {row['communication_ms']:.1f} ms in collectives")
    for result in results:
        pool = result.pool[max(result.pool)]
        print(f"  rank {result.rank}: {pool['used_blocks']}/{pool['num_blocks']} blocks, {pool['tokens']} K/V tokens, "
              f"weights {result.weight_bytes['total']} bytes")


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    if "RANK" not in os.environ:      # not under torchrun: start the ranks here
        spec = context_sweep_specs(args.nproc, (args.context,), (args.placement,), args.decode_steps,
                                   strategy=args.expert_placement)[0]
        report(spec, run_parallel([spec], args.nproc, timeout_s=args.timeout)[0])
        return 0
    backend = default_backend()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()   # progress keys for naming a failed rank
    except Exception:   # noqa: BLE001: without it, errors name only the collective
        store = None
    spec = context_sweep_specs(world_size, (args.context,), (args.placement,), args.decode_steps,
                               strategy=args.expert_placement)[0]
    context = WorkerContext(rank, world_size, Communicator(rank, world_size, device, store), device)
    mine = run_specs(context, [spec])[0]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)                   # the report only, after the measured steps
    if rank == 0:
        report(spec, everyone)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
