"""`torchrun --nproc_per_node=N -m moekv_ref.parallel ...`: the program is apps/parallel_run.py."""

from ..apps.parallel_run import main

if __name__ == "__main__":
    raise SystemExit(main())
