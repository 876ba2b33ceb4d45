"""The programs built on the library: each module here is run, not imported by the library.

    cli.py            `python -m moekv_ref COMMAND`: generate, routing-stats, demo, bench, figures
    demo.py           the main job: a stream of requests served through a small paged pool
    bench_memory.py   memory designs (paged, shared tails, reserved, first-fit) on routing traces
    bench_serving.py  static vs continuous batching on one memory budget
    bench_simulator.py  the simulator's own speed: beside another checkout, or at scale
    figures.py        regenerates every PNG in figures/
    train.py          trains the embedded checkpoint
    parallel_run.py   `torchrun -m moekv_ref.apps.parallel_run`: one run of the context sweep on real ranks
    parallel_measure.py  the context sweep (`bench parallel`, parallel_run, notebook 07) and its tables
    parallel_options.py  the values those two parallel programs accept, checked before anything starts

Nothing in the library imports from it: data flows from the library to the programs. Only the entry
point moekv_ref/__main__.py hands its command line here; parallel_run runs as itself (`-m`).
"""
