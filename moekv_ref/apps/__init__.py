"""The programs built on the library: each module here is run, not imported by the library.

    cli.py            `python -m moekv_ref COMMAND`: generate, routing-stats, demo, bench, figures
    demo.py           the main job: a stream of requests served through a small paged pool
    bench_memory.py   memory designs (paged, shared tails, reserved, first-fit) on routing traces
    bench_serving.py  static vs continuous batching on one memory budget
    figures.py        regenerates every PNG in figures/
    train.py          trains the embedded checkpoint

Nothing in moekv_ref outside this folder imports from it: data flows from the library to the programs.
"""
