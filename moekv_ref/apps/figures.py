"""Regenerate every PNG in figures/ from the package: `python -m moekv_ref figures`.

Each figure is drawn by the same package functions the notebooks call, from a fresh run:
    routing_layer0.png, cache_sizes.png    the embedded model's routing and per-expert caches (02)
    decode_cost.png                        counted work of a decode step, recompute vs cached (01)
    bench_memory_*.png, bench_memory.json  the memory designs of `bench memory` (03)
    demo_serving_*.png                     the serving demo's runs (04)
    capacity_frontier.png                  from figures/capacity.json (`capacity` trains and measures: 10)
    reservation_study.png                  from figures/reservation_study.json (`bench reservation`)
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from ..analysis import decode_flops, route_prompt
from ..checkpoint import load_default_model
from ..generate import generate
from ..jsonout import dumps
from ..plots.capacity import plot_capacity
from ..plots.reservation import plot_reservation
from ..plots.routing import plot_cache_sizes, plot_routing
from ..sampling import SamplingParams
from . import bench_memory, bench_reservation, demo, options


def make_figures(directory: Path = Path("figures"), quick: bool = False) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    model = load_default_model("topk")

    text = "def fibonacci(n):\n    return n"
    fig = Figure(figsize=(10, 3))
    ax = fig.subplots()
    plot_routing(route_prompt(model, text), text, layer=0, ax=ax)
    fig.tight_layout()
    paths.append(directory / "routing_layer0.png")
    fig.savefig(paths[-1], dpi=110)

    result = generate(
        model, [list(b"import os\n\ndef main():\n    ")], SamplingParams(max_new_tokens=48, temperature=0)
    )
    fig = Figure(figsize=(9, 3))
    ax = fig.subplots()
    plot_cache_sizes(result.cache_counts[0], ax=ax)
    fig.tight_layout()
    paths.append(directory / "cache_sizes.png")
    fig.savefig(paths[-1], dpi=110)

    lengths = [16, 32, 64, 128, 256, 511]
    fig = Figure(figsize=(5.5, 3.5))
    ax = fig.subplots()
    for cached, label in ((False, "recompute"), (True, "cached")):
        ax.plot(lengths, [decode_flops(model.config, t, cached) / 1e6 for t in lengths], "o-", label=label)
    ax.set(
        xlabel="tokens already in the sequence",
        ylabel="MFLOP per decode step",
        yscale="log",
        title="tiny: work of one decode step",
    )
    ax.legend()
    fig.tight_layout()
    paths.append(directory / "decode_cost.png")
    fig.savefig(paths[-1], dpi=110)

    report = bench_memory.run(bench_memory.DEFAULT_BLOCK_SIZE, quick=quick)
    (directory / "bench_memory.json").write_text(dumps(report, indent=1))
    paths += bench_memory.save_figures(report, directory)

    for admission in ("predicted", "optimistic"):
        summary, _ = demo.run_demo(admission=admission, figures=directory, progress=False)
        paths.append(Path(summary["figure"]))

    study = directory / "capacity.json"  # an hour of training: redrawn from its JSON, not rerun
    if study.exists():
        paths.append(directory / "capacity_frontier.png")
        plot_capacity(json.loads(study.read_text())).savefig(paths[-1], dpi=110)
    study = directory / "reservation_study.json"  # hours of simulation: redrawn from its JSON
    if study.exists():
        paths.append(directory / "reservation_study.png")
        figure = plot_reservation(
            json.loads(study.read_text()), bench_reservation.GATE, bench_reservation.PASS_MARK
        )
        figure.savefig(paths[-1], dpi=110)
    return paths


def build_parser(parser):
    parser.add_argument("--out", default="figures", help="folder for the PNGs (made if missing)")
    parser.add_argument("--quick", action="store_true", help="smaller memory benchmark")
    return parser


def check_args(args) -> None:
    """--out is a folder (or not there yet); --quick is a switch."""
    options.folder("--out", args.out)


def main(args) -> int:
    check_args(args)
    for path in make_figures(Path(args.out), quick=args.quick):
        print(f"wrote {path}")
    return 0
