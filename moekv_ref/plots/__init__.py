"""Every figure the notebooks, the demo and figures/ draw, in one place.

    routing.py   which experts each token chose; tokens held per (layer, expert)
    memory.py    memory maps (first-fit address space, paged pool) and the memory benchmark's sweeps
    serving.py   an engine run: request timelines, pool use per step, predicted vs actual demand
    eviction.py  per-device pools under victim policies, what evictions free, density, recompute vs swap
    parallel.py  expert parallelism: bytes per step vs context, K/V locations, per-rank pools,
                 expert placements, projected step times

Plotting functions take the objects the library returns and an optional matplotlib axis; they
compute nothing that a test of the library does not already cover.
"""
