"""The documentation points only at things a reader can open: every file, notebook and figure that
README.md, docs/glossary.md, docs/design.md and docs/results.md name exists, and every link to a
section names a heading of its page; every function or class a glossary link names is defined in the
file it links to; every notebook section it names is a heading of that notebook; and every row of the
glossary's tables links to code and to a notebook (or says it is not built yet). Every number the
README's findings and docs/results.md's tables quote is read here from its JSON in figures/."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from moekv_ref.apps import bench_reservation
from moekv_ref.config import PRESETS, get_config
from moekv_ref.jsonout import dumps, strict_json

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
RESULTS = DOCS / "results.md"  # the benchmarks' tables, moved out of the README
PAGES = [README, DOCS / "glossary.md", DOCS / "design.md", RESULTS]
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
PATH_IN_BACKTICKS = re.compile(r"`([\w.-]+/[\w./-]*)`")
FILE_SUFFIXES = (".py", ".ipynb", ".png", ".json", ".md", ".txt", ".pt")


def _links(page: Path):
    for text, target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        yield text, (page.parent / target.split("#")[0]).resolve()


def _headings(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return [
        " ".join(line.lstrip("#").split())
        for cell in cells
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
        if line.startswith("#")
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_linked_or_named_path_exists(page):
    missing = [str(target.relative_to(ROOT)) for _, target in _links(page) if not target.exists()]
    for path in PATH_IN_BACKTICKS.findall(page.read_text()):
        if path.endswith("/") or path.endswith(FILE_SUFFIXES):
            # a bare package folder (`cache/`) is named from inside moekv_ref/
            if not (ROOT / path).exists() and not (ROOT / "moekv_ref" / path).exists():
                missing.append(path)
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_glossary_code_links_name_functions_defined_in_their_files():
    undefined = []
    for text, target in _links(DOCS / "glossary.md"):
        if target.suffix != ".py" or text.endswith(".py"):
            continue
        source = target.read_text()
        for name in text.strip("`").split("."):
            if not re.search(rf"^\s*(def|class)\s+{re.escape(name)}\b", source, re.MULTILINE):
                undefined.append(f"{name} in {target.relative_to(ROOT)}")
    assert not undefined, f"glossary links name things their files do not define: {undefined}"


def test_glossary_notebook_sections_are_headings():
    unknown = []
    for text, target in _links(DOCS / "glossary.md"):
        if target.suffix != ".ipynb" or "›" not in text:
            continue
        section = " ".join(text.split("›", 1)[1].split())
        if not any(section in heading for heading in _headings(target)):
            unknown.append(f"{section!r} in {target.name}")
    assert not unknown, f"glossary names notebook sections that are not headings: {unknown}"


def test_every_glossary_row_links_code_and_a_notebook():
    rows = [line for line in (DOCS / "glossary.md").read_text().splitlines() if line.startswith("| **")]
    assert len(rows) >= 20  # six problems and the concepts
    for row in rows:
        targets = [target for _, target in LINK.findall(row)]
        assert any(t.endswith(".py") for t in targets), f"no code link in: {row[:80]}"
        assert any(t.endswith(".ipynb") for t in targets) or "not built yet" in row, (
            f"no notebook in: {row[:80]}"
        )


def test_results_bytes_per_token_table_is_what_the_configs_compute():
    """docs/results.md's bytes-per-token table, row by row, against kv_bytes_per_token (changing either
    makes this fail)."""
    results = RESULTS.read_text(encoding="utf-8")
    rows = re.findall(
        r"^\| `([\w.-]+)`[^|]*\| [^|]+\| (\d+) \| (\d+) \| ([\d,]+) \(\w+\) \| ([\d,]+) \|$", results, re.M
    )
    assert {name for name, *_ in rows} == set(PRESETS), rows
    for name, entries, layers, per_entry, per_token in rows:
        config = get_config(name)
        assert int(entries) == config.kv_entries_per_layer, name
        assert int(layers) == config.num_hidden_layers, name
        assert int(per_entry.replace(",", "")) == config.kv_bytes_per_entry(), name
        assert int(per_token.replace(",", "")) == config.kv_bytes_per_token, name


def test_results_bench_peer_table_is_what_its_json_says():
    """Each tokens/s and ratio of docs/results.md's `bench peer` table against figures/bench_peer.json."""
    measured = json.loads((ROOT / "figures" / "bench_peer.json").read_text(encoding="utf-8"))["paths"]
    results = RESULTS.read_text(encoding="utf-8")
    section = results.split("(`bench peer`)", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| ([\d,]+) \| (\d\.\d\d) \|$", section, re.M)
    keys = {
        "Hugging Face": "hf",
        '"paged"': "paged",
        '"contiguous"': "contiguous",
        "generate_with_engine": "engine",
    }
    assert len(rows) == 4, rows
    for label, tokens_per_s, ratio in rows:
        key = next(k for word, k in keys.items() if word in label)
        assert int(tokens_per_s.replace(",", "")) == round(measured[key]["tokens_per_s"]), label
        assert float(ratio) == round(measured[key]["ratio_vs_hf"], 2), label
        assert measured[key]["identical_tokens"], label


def test_results_parallel_table_is_what_its_json_says():
    """Each byte count of docs/results.md's `bench parallel` table, its weight bytes per rank and the
    ratio quoted under it, against figures/bench_parallel.json."""
    measured = json.loads((ROOT / "figures" / "bench_parallel.json").read_text(encoding="utf-8"))
    results = RESULTS.read_text(encoding="utf-8")
    section = results.split("(`bench parallel`)", 1)[1].split("\n## ", 1)[0]
    assert f"over {measured['world_size']} CPU ranks" in section
    header = re.search(r"^\| placement \| context (\d+) \| (\d+) \| (\d+) \|", section, re.M)
    contexts = [int(c) for c in header.groups()]
    rows = re.findall(
        r"^\| `(\w+)`[^|]* \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) B \|$", section, re.M
    )
    assert [name for name, *_ in rows] == measured["kv_placements"], rows
    by_key = {(r["kv_placement"], r["context"]): r for r in measured["bytes_per_decode_step"]}
    for name, *cells in rows:
        *steps, weights = (int(cell.replace(",", "")) for cell in cells)
        assert steps == [by_key[name, c]["bytes_per_decode_step"] for c in contexts], name
        assert {weights} == set(by_key[name, contexts[-1]]["attention_weight_bytes_per_rank"]), name
    ratio = re.search(r"moves (\d+)x what `kv_with_expert` does at context (\d+)", section)
    assert int(ratio[1]) == round(measured["kv_with_sequence_over_kv_with_expert"][ratio[2]]), ratio[0]


def test_results_eviction_table_is_what_its_json_says():
    """Each row of docs/results.md's `bench eviction` policy table against figures/bench_eviction.json
    (recompute) and figures/bench_eviction_swap.json (swap)."""
    runs = [
        json.loads((ROOT / "figures" / name).read_text(encoding="utf-8"))["workload"]
        for name in ("bench_eviction.json", "bench_eviction_swap.json")
    ]
    results = RESULTS.read_text(encoding="utf-8")
    section = results.split("(`bench eviction`)", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| (\w+)[^|]* \| (\d+) \| (\d+\.\d\d) \| (\d+) \| (\d+) \| (\d+\.\d\d) \| (\d+\.\d) \|$",
        section,
        re.M,
    )
    assert len(rows) == 5, rows
    for name, *cells in rows:
        recompute, swap = (run["policies"][name] for run in runs)
        assert cells == [
            str(recompute["steps"]),
            f"{recompute['tokens_per_step']:.2f}",
            str(recompute["recomputed_tokens"]),
            str(swap["steps"]),
            f"{swap['tokens_per_step']:.2f}",
            f"{swap['swapped_bytes'] / 1e6:.1f}",
        ], name
    bound = re.search(r"^\| memory-time bound \| (\d+) \| (\d+\.\d\d) \|", section, re.M)
    assert bound.groups() == (
        f"{runs[0]['bound']['steps']:.0f}",
        f"{runs[0]['bound']['tokens_per_step']:.2f}",
    )


def test_results_eviction_prose_is_what_its_json_says():
    """The numbers in the words around docs/results.md's eviction tables: the policies' spread, the
    evictions they make, the optimum's spread, the engine run and the prefix-cache table."""
    runs = [
        json.loads((ROOT / "figures" / name).read_text(encoding="utf-8"))
        for name in ("bench_eviction.json", "bench_eviction_swap.json")
    ]
    results = RESULTS.read_text(encoding="utf-8")
    section = re.sub(r"\s+", " ", results.split("(`bench eviction`)", 1)[1].split("\n## ", 1)[0])
    policies = [run["workload"]["policies"] for run in runs]
    rates = [p["tokens_per_step"] for run in policies for p in run.values()]
    spread = 100 * (max(rates) / min(rates) - 1)
    assert f"tokens/step differ by at most {spread:.1f}% over both runs" in section, spread
    evictions = [p["evictions"] for run in policies for name, p in run.items() if name != "oracle"]
    fewest, most = map(int, re.search(r"\((\d+) to (\d+); the oracle none\)", section).groups())
    assert (fewest, most) == (min(evictions), max(evictions))
    assert all(run["oracle"]["evictions"] == 0 for run in policies)

    instances = json.loads((ROOT / "figures" / "eviction_optimum.json").read_text(encoding="utf-8"))[
        "instances"
    ]
    extra = [100 * (i["optimum"]["worst_steps"] / i["optimum"]["steps"] - 1) for i in instances]
    assert re.search(
        rf"the worst schedule takes {round(min(extra))}-{round(max(extra))}% more steps", section
    )

    engine = runs[0]["engine"]["policies"]
    line = re.search(
        r"steps (\d+) \(newest_first, sequence_lru\), (\d+) \(expert_lru, (\d+) row evictions, "
        r"([\d.]+) blocks freed on the short device per eviction\), (\d+) \(pressure_aware, (\d+) "
        r"tokens recomputed against (\d+)\)",
        section,
    )
    assert line.groups() == (
        str(engine["newest_first"]["num_steps"]),
        str(engine["expert_lru"]["num_steps"]),
        str(engine["expert_lru"]["num_row_evictions"]),
        f"{engine['expert_lru']['freed_on_short_device_per_eviction']:.1f}",
        str(engine["pressure_aware"]["num_steps"]),
        str(engine["pressure_aware"]["num_recomputed_tokens"]),
        str(engine["sequence_lru"]["num_recomputed_tokens"]),
    ), line.groups()
    assert engine["newest_first"]["num_steps"] == engine["sequence_lru"]["num_steps"]

    table = re.findall(
        r"\| (topk|threshold) \| (off|on) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|",
        section,
    )
    assert len(table) == 4, table
    for routing, cache, *cells in table:
        run = runs[0]["prefix_cache"]["routings"][routing][cache]
        hits = run["prefix_cache"] or {}
        assert cells == [
            str(v)
            for v in (
                run["num_steps"],
                run["num_computed_tokens"],
                hits.get("num_hit_tokens", 0),
                hits.get("num_shared_blocks", 0),
                hits.get("num_cow_blocks", 0),
                run["num_prompt_blocks"],
                round(run["tokens_per_second"]),
            )
        ], (routing, cache)
    for routing in ("topk", "threshold"):
        r = runs[0]["prefix_cache"]["routings"][routing]
        assert (
            f"- {routing}: hit rate {r['token_hit_rate']:.3f} of tokens, {r['block_hit_rate']:.3f} of the prompts' "
            f"blocks; prefill tokens saved {r['prefill_tokens_saved']}, steps saved {r['steps_saved']}, tokens/s "
            f"x{r['tokens_per_second_ratio']:.2f}; outputs equal: {r['outputs_equal']}"
        ) in section, routing


def test_results_optimum_table_is_what_its_json_says():
    """Each row of docs/results.md's table of the exact optimum against figures/eviction_optimum.json."""
    rows = json.loads((ROOT / "figures" / "eviction_optimum.json").read_text(encoding="utf-8"))["instances"]
    results = RESULTS.read_text(encoding="utf-8")
    section = results.split("(`bench eviction --optimum`", 1)[1].split("\n## ", 1)[0]
    header = (
        re.search(r"^\| instance \| optimum \| worst \| (.+) \| schedules \|$", section, re.M)
        .group(1)
        .split(" | ")
    )
    found = re.findall(r"^\| (\d+) seqs, (\d+) out, seed (\d+) \| ([\d |]+) \|$", section, re.M)
    assert len(found) == len(rows) == 4, found
    for (sequences, output, seed, cells), row in zip(found, rows):
        assert (int(sequences), int(output), int(seed)) == (
            row["num_sequences"],
            row["mean_output"],
            row["seed"],
        )
        expected = [
            row["optimum"]["steps"],
            row["optimum"]["worst_steps"],
            *(row["policies"][name]["steps"] for name in header),
            row["optimum"]["leaves"],
        ]
        assert [int(c) for c in cells.split(" | ")] == expected, sequences


def test_notebook_07_prose_numbers_are_its_outputs_or_its_hardware():
    """Notebook 07's prose quotes its own results: every ratio ("61x"), every number written with
    thousands separators ("1,656") and every time in ms must appear in the notebook's stored
    outputs, and every bandwidth or FLOP rate it states must be one of the hardware table's
    (moekv_ref/costs.py). A re-run that changes a result, or a hand edit of the prose, fails here."""
    from moekv_ref.costs import GPUS, LINKS

    cells = json.loads((ROOT / "notebooks" / "07_expert_parallelism.ipynb").read_text(encoding="utf-8"))[
        "cells"
    ]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    outputs = "\n".join(
        "".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c["outputs"]
    )
    quoted = (
        re.findall(r"\b(\d+(?:\.\d+)?x)\b", prose)
        + re.findall(r"\b(\d+(?:\.\d+)? ms)\b", prose)
        + [n.replace(",", "") for n in re.findall(r"\b\d{1,3}(?:,\d{3})+\b", prose)]
    )
    assert quoted, "the prose quotes no result: the pattern has drifted from the text"
    missing = [q for q in quoted if not re.search(rf"(?<![\d.]){re.escape(q)}(?![\d])", outputs)]
    assert not missing, f"notebook 07's prose quotes {missing}, which no stored output shows"
    stated = {
        float(n) * {"TB/s": 1e12, "GB/s": 1e9, "TFLOP/s": 1e12}[unit]
        for n, unit in re.findall(r"\b(\d+(?:\.\d+)?) (TB/s|GB/s|TFLOP/s)", prose)
    }
    known = (
        {g.hbm_bytes_per_s for g in GPUS.values()}
        | {g.bf16_flops_per_s for g in GPUS.values()}
        | {link.bytes_per_s for link in LINKS.values()}
    )
    assert stated and stated <= known, (
        f"rates in the prose but not in the hardware table: {sorted(stated - known)}"
    )


SMALL_TEXT = re.compile(
    r"(?:fontsize|labelsize|title_fontsize)\s*=\s*(\d+(?:\.\d+)?)|set_fontsize\((\d+(?:\.\d+)?)\)"
    r"|[\"'](?:font\.size|(?:x|y)tick\.labelsize|legend\.fontsize)[\"']\s*(?:\]\s*=|:|,)\s*(\d+(?:\.\d+)?)"
)


def _figure_code():
    for path in sorted((ROOT / "moekv_ref" / "plots").glob("*.py")):
        yield path.name, path.read_text(encoding="utf-8")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        yield path.name, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_no_figure_text_is_smaller_than_the_notebooks_own():
    """JupyterLab's text is 14 px; a figure shown at 100 dpi draws a point as 100/72 px, so 10 pt
    (matplotlib's default size) is the notebook's size. No plot and no notebook asks for less."""
    small = [
        (name, size)
        for name, code in _figure_code()
        for match in SMALL_TEXT.finditer(code)
        for size in match.groups()
        if size and float(size) < 10
    ]
    assert not small, small
    # the pattern sees what it must: a size of 8 written the ways the plots write sizes
    assert all(
        SMALL_TEXT.search(code)
        for code in (
            "ax.legend(fontsize=8)",
            "t.set_fontsize(8)",
            "ax.tick_params(labelsize=8)",
            "rcParams['font.size'] = 8",
        )
    )


def test_results_serving_budget_table_is_what_its_json_says():
    """Each row of docs/results.md's budgeted `bench serving` table, the pool and budget it states and the
    ratio under it, against figures/bench_serving_budget.json."""
    measured = json.loads((ROOT / "figures" / "bench_serving_budget.json").read_text(encoding="utf-8"))
    results = RESULTS.read_text(encoding="utf-8")
    section = results.split("(`capacity`, `bench serving --budget`)", 1)[1].split("\n## ", 1)[0]
    memory, budget, n = measured["memory_budget"], measured["budget"], measured["workload"]["num_requests"]
    prose = " ".join(section.split())  # lines folded
    assert f"a pool of {memory['num_blocks']} blocks of {memory['block_size']}" in prose
    assert f"a window of {budget['max_tokens']} tokens a row" in prose and budget["policy"] == "window"
    rows = re.findall(
        r"^\| ([a-z_]+(?: \+ budget)?) \| (\d+) of (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \|$",
        section,
        re.M,
    )
    assert [r[0] for r in rows] == list(measured["designs"]), rows
    for design, served, total, tokens_per_s, steps, running, preemptions, used in rows:
        row = measured["designs"][design]
        assert (int(served), int(total)) == (n - row["refused"], n), design
        assert int(tokens_per_s) == round(row["tokens_per_second"]), design
        assert (int(steps), int(preemptions)) == (row["steps"], row["preemptions"]), design
        assert (
            running == f"{row['mean_concurrent_sequences']:.1f}"
            and used == f"{row['mean_used_fraction']:.2f}"
        ), design
    designs = measured["designs"]
    refused = re.search(r"refuses the (\d+) requests", prose)
    assert int(refused[1]) == designs["continuous_reserved"]["refused"]
    ratio = re.search(r"at (\d\.\d)x the tokens/s", prose)
    assert float(ratio[1]) == round(
        designs["continuous_reserved + budget"]["tokens_per_second"]
        / designs["continuous_reserved"]["tokens_per_second"],
        1,
    )
    assert measured["same_tokens_in_every_budgeted_design"]
    quality = measured["quality"]  # what the budget costs the model, beside its tokens/s
    short, long = quality["128"], quality["512"]
    assert (
        f"the window gives {short['bits_per_byte_budget']:.3f} bits per byte against "
        f"{short['bits_per_byte_exact']:.3f} with the exact cache ({short['cost_bits_per_byte']:+.3f})"
        in prose
    )
    assert (
        f"{long['bits_per_byte_budget']:.3f} against {long['bits_per_byte_exact']:.3f}: the window helps"
        in prose
    )
    assert long["cost_bits_per_byte"] < 0 and not measured["commit"].endswith("-dirty")


def test_every_committed_json_is_strict_json():
    """JSON has no Infinity or NaN: a strict parser (JupyterLab's) refuses a file that holds one. bench
    eviction once wrote swap_bytes_per_second = Infinity; every writer now writes null (jsonout)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [ROOT / name for name in tracked.stdout.splitlines() if name.endswith((".json", ".ipynb"))]
    assert any(path.parent.name == "figures" for path in paths)
    for path in sorted(set(paths) | set((ROOT / "figures").glob("*.json"))):
        json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)
    json.loads(dumps({"x": float("nan")}), parse_constant=refuse)
    with pytest.raises(ValueError):
        json.loads(json.dumps({"x": float("nan")}), parse_constant=refuse)
    assert strict_json({"a": [1.0, float("inf"), {"b": float("nan")}], "c": (2, -float("inf"))}) == {
        "a": [1.0, None, {"b": None}],
        "c": [2, None],
    }


def test_every_json_file_is_written_strict():
    """Every JSON file the code writes goes through jsonout (no Infinity or NaN), not json.dump or a
    write_text of json.dumps (which write them)."""
    for root in ("moekv_ref", "moekv_kernels"):
        for path in sorted((ROOT / root).rglob("*.py")):
            if path.name == "jsonout.py":
                continue
            text = path.read_text(encoding="utf-8")
            assert "json.dump(" not in text, path
            assert not re.search(r"write(_text)?\(json\.dumps", text), path


def cluster_rows(result: dict) -> list[str]:
    """docs/results.md's `bench cluster` table rows, from figures/bench_cluster.json."""
    return [
        f"| {r['gib_per_device']:g} | {r['rate']:g} | {r['reservation']} | {r['policy']} | {r['slo_attainment']:.3f} "
        f"| {r['ttft_p99_s']:.3f} | {r['mean_used_fraction']:.2f} "
        f"| {r['victim_sequences']} | {r['retries']} | {r['thrown_away_tokens']} |"
        for r in result["runs"]
    ]


def speed_rows(result: dict) -> list[str]:
    """docs/results.md's simulator-speed table rows, from figures/bench_cluster_speed.json."""
    return [
        f"| {r['layers']} layers, {r['experts']} experts top-{r['top_k']}, {r['devices']} devices "
        f"| {r['against']['requests_per_second']:.1f} | {r['against']['steps_per_second']:.1f} "
        f"| {r['this']['requests_per_second']:.1f} | {r['this']['steps_per_second']:.1f} | {r['speedup']:.2f}x |"
        for r in result["shapes"]
    ]


def group_rows(result: dict) -> list[str]:
    """docs/results.md's table of clusters of several groups, from figures/bench_cluster_groups.json."""
    return [
        f"| {r['devices']} ({r['groups']}) | {r['reservation']} | {r['policy']} | {r['slo_attainment']:.3f} "
        f"| {r['ttft_p99_s']:.3f} | {r['victim_sequences']} "
        f"| {r['thrown_away_tokens']} |"
        for r in result["runs"]
    ]


def test_results_groups_of_gpus_are_what_their_json_says():
    """The table of 8, 16 and 64 GPUs and the prose under it, against figures/bench_cluster_groups.json;
    its 8-GPU runs are those of figures/bench_cluster.json."""
    results = RESULTS.read_text(encoding="utf-8")
    section = results.split("More GPUs than experts", 1)[1].split("Multi-turn sessions", 1)[0]
    groups = json.loads((ROOT / "figures" / "bench_cluster_groups.json").read_text(encoding="utf-8"))
    cluster = json.loads((ROOT / "figures" / "bench_cluster.json").read_text(encoding="utf-8"))
    assert [line for line in section.splitlines() if re.match(r"^\| \d+ \(\d+\) \|", line)] == group_rows(
        groups
    )
    prose = " ".join(section.split())
    runs = groups["runs"]
    assert {(r["devices"], r["groups"]) for r in runs} == {(8, 1), (16, 2), (64, 8)}
    assert all(r["gib_per_device"] == 0.5 and r["rate"] == 150 for r in runs) and groups["requests"] == 150
    single = {
        (r["reservation"], r["policy"]): r
        for r in cluster["runs"]
        if (r["gib_per_device"], r["rate"]) == (0.5, 150)
    }
    for run in runs:
        if run["devices"] == 8:
            assert run["slo_attainment"] == single[run["reservation"], run["policy"]]["slo_attainment"]
    means = {r["devices"]: f"{r['prompt_tokens'] / r['requests']:,.0f}" for r in runs}
    assert f"({means[16]} and {means[64]} prompt tokens on average, against {means[8]})" in prose
    worst = [r for r in runs if r["reservation"] == "worst_case"]
    assert all(abs(r["slo_attainment"] - (1 - r["refused"] / r["requests"])) < 1e-9 for r in worst)
    shares = [f"{r['slo_attainment']:.3f}" for r in worst[::3]]  # one a cluster: the victims tie
    assert f"({shares[0]}, {shares[1]} and {shares[2]};" in prose
    leaders, bests = [], []
    for devices in (8, 16, 64):
        optimistic = {
            r["policy"]: r["slo_attainment"]
            for r in runs
            if r["devices"] == devices and r["reservation"] == "optimistic"
        }
        leaders.append(max(optimistic, key=optimistic.get))
        bests.append(max(optimistic.values()))
        worst_case = next(r["slo_attainment"] for r in worst if r["devices"] == devices)
        assert bests[-1] <= worst_case
    assert leaders == ["sequence_lru", "pressure_aware", "pressure_aware"]
    assert "(`sequence_lru` first at 8 GPUs, `pressure_aware` at 16 and 64)" in prose
    assert f"({bests[0]:.3f}, {bests[1]:.3f} and {bests[2]:.3f})" in prose


def test_results_cluster_tables_are_what_their_json_says():
    """Every row of docs/results.md's `bench cluster` tables, and the settings its prose states, against
    figures/bench_cluster.json and figures/bench_cluster_speed.json."""
    results = RESULTS.read_text(encoding="utf-8")
    section = results.split("(`bench cluster`)", 1)[1].split("\n## ", 1)[0]
    cluster = json.loads((ROOT / "figures" / "bench_cluster.json").read_text(encoding="utf-8"))
    speed = json.loads((ROOT / "figures" / "bench_cluster_speed.json").read_text(encoding="utf-8"))
    table = [
        line
        for line in section.splitlines()
        if re.match(r"^\| [\d.]+ \| [\d.]+ \| (worst_case|optimistic) ", line)
    ]
    assert table == cluster_rows(cluster)
    assert [
        line for line in section.splitlines() if " experts top-" in line and line.startswith("|")
    ] == speed_rows(speed)
    prose = " ".join(section.split())
    assert (
        f"{cluster['requests']} requests" in prose and f"{speed['shapes'][0]['requests']} requests" in prose
    )
    for line in re.findall(r"(\d+\.\d+)x faster", prose):
        assert any(f"{r['speedup']:.2f}" == line for r in speed["shapes"]), line
    # the victims' attainments under optimistic reservation, and how their order changes
    attain = {
        (r["gib_per_device"], r["rate"], r["reservation"], r["policy"]): r["slo_attainment"]
        for r in cluster["runs"]
    }
    assert (
        f"`sequence_lru` {attain[0.5, 150.0, 'optimistic', 'sequence_lru']:.3f} against "
        f"{attain[0.5, 150.0, 'optimistic', 'expert_lru']:.3f} for the other two"
        in prose
        and attain[0.5, 150.0, "optimistic", "expert_lru"]
        == attain[0.5, 150.0, "optimistic", "pressure_aware"]
    )
    at_300 = {
        p: attain[0.5, 300.0, "optimistic", p] for p in ("sequence_lru", "pressure_aware", "expert_lru")
    }
    assert max(at_300, key=at_300.get) == "pressure_aware"
    assert f"`pressure_aware` leads with {at_300['pressure_aware']:.3f}" in prose
    coarse, fine = speed["shapes"]
    assert f"{fine['speedup']:.2f}x faster at the fine-grained shape and {coarse['speedup']:.2f}x" in prose
    assert f"the old code took {fine['against']['wall_seconds']:.1f} s at the fine shape" in prose
    assert fine["this"]["max_running"] <= 256 and fine["this"]["blocks_in_use_summed"] > 0
    scale = json.loads((ROOT / "figures" / "bench_cluster_scale.json").read_text(encoding="utf-8"))
    from moekv_ref.apps.bench_simulator import SCALE_ROUTINGS, SPEED_SHAPES

    assert (scale["layers"], scale["experts"], scale["top_k"], scale["devices"]) == SPEED_SHAPES[1][:4]
    assert scale["distinct_routings"] == SCALE_ROUTINGS == 32768 and "a bank of 32,768 routings" in prose
    assert f"{scale['requests']:,} requests on the fine-grained shape" in prose
    assert f"run from commit {scale['commit']}" in prose and not scale["commit"].endswith("-dirty")
    assert scale["finished"] == scale["requests"] and "every request finished" in prose
    assert f"took {scale['total_seconds'] / 60:.1f} minutes" in prose
    assert f"{scale['trace_seconds']:.1f} s for the trace, {scale['setup_seconds']:.1f} s to set" in prose
    assert f"{scale['run_seconds']:.1f} s to run {scale['steps']:,} steps" in prose
    assert f"({scale['steps_per_second']:.1f} steps/s, up to {scale['max_running']} running)" in prose
    assert f"would take about {scale['projected_seconds_for_1e6'] / 3600:.1f} hours" in prose
    assert scale["threads"] == 2 and "two threads" in prose
    runs = cluster["runs"]
    worst = [r["mean_used_fraction"] for r in runs if r["reservation"] == "worst_case"]
    assert f"stay {round(100 * min(worst))}-{round(100 * max(worst))}% full" in prose
    short = [r for r in runs if r["reservation"] == "optimistic" and r["retries"]]
    used = [r["mean_used_fraction"] for r in short]
    assert f"fills them to {round(100 * min(used))}-{round(100 * max(used))}%" in prose
    thrown = [r["thrown_away_tokens"] / 1e6 for r in short]
    assert f"{min(thrown):.1f} to {max(thrown):.1f} million tokens" in prose
    needed = cluster["requests"] * (cluster["prompt_tokens_mean"] + cluster["output_tokens_mean"]) / 1e6
    assert f"the {needed:.1f} million the requests need" in prose
    seed1 = json.loads((ROOT / "figures" / "bench_cluster_seed1.json").read_text(encoding="utf-8"))
    other = {
        (r["gib_per_device"], r["rate"], r["reservation"], r["policy"]): r["slo_attainment"]
        for r in seed1["runs"]
    }
    tie = other[0.5, 150.0, "optimistic", "sequence_lru"]
    assert (
        tie
        == other[0.5, 150.0, "optimistic", "pressure_aware"]
        == max(other[0.5, 150.0, "optimistic", p] for p in ("sequence_lru", "pressure_aware", "expert_lru"))
    )
    assert f"`sequence_lru` and `pressure_aware` tie at {tie:.3f} at 150" in prose
    bursty = json.loads((ROOT / "figures" / "bench_cluster_gamma.json").read_text(encoding="utf-8"))
    from moekv_ref.apps.bench_cluster import GAMMA_CV

    assert GAMMA_CV == 2 and {r["arrivals"] for r in bursty["runs"]} == {"gamma"}
    assert "a coefficient of variation of 2" in prose
    assert all(r["victim_sequences"] == 0 for r in bursty["runs"] if r["reservation"] == "worst_case")
    gamma = {(r["rate"], r["reservation"], r["policy"]): r["slo_attainment"] for r in bursty["runs"]}
    assert (
        f"`expert_lru` leads at 150 requests/s ({gamma[150.0, 'optimistic', 'expert_lru']:.3f} against "
        f"{gamma[150.0, 'optimistic', 'sequence_lru']:.3f})"
    ) in prose
    assert (
        max(gamma[k] for k in gamma if k[:2] == (150.0, "optimistic"))
        == gamma[150.0, "optimistic", "expert_lru"]
    )
    for result in (cluster, seed1):  # "nothing is ever preempted"
        assert all(
            r["victim_sequences"] == 0 and r["retries"] == 0
            for r in result["runs"]
            if r["reservation"] == "worst_case"
        )
    for result in (cluster, seed1):  # "expert_lru is never the best"
        assert all(
            row["best_policy"] != "expert_lru"
            for row in result["where_policies_differ"]
            if row["gain"] and row["gain"] > 0
        )


def session_rows(result: dict) -> list[str]:
    """docs/results.md's multi-turn table rows, from figures/bench_cluster_sessions.json."""
    pairs = {(p["gib_per_device"], p["rate"]): p for p in result["prefix_caching"]}
    rows = []
    for r in result["runs"]:
        pair = pairs[(r["gib_per_device"], r["rate"])]
        found = f"{pair['hit_share_of_shareable']:.1%}" if r["prefix_caching"] else "-"
        rows.append(
            f"| {r['gib_per_device']:g} | {r['rate']:g} | {'on' if r['prefix_caching'] else 'off'} | {found} "
            f"| {r['ttft_p50_s'] * 1e3:.2f} | {r['ttft_p99_s'] * 1e3:.2f} | {r['slo_attainment']:.3f} "
            f"| {r['victim_sequences']} | {r['refused']} |"
        )
    return rows


def test_results_sessions_table_and_ranges_are_what_their_json_says():
    """The multi-turn table row by row, and every range the prose quotes (what the cache found, per
    memory and seed; TTFT p50 and p99 changes over both seeds; the refused share; prompt means),
    computed from the two JSON files."""
    from moekv_ref.sim.workloads import session_workloads

    results = RESULTS.read_text(encoding="utf-8")
    flat = " ".join(results.split())
    seeds = [
        json.loads((ROOT / "figures" / name).read_text(encoding="utf-8"))
        for name in ("bench_cluster_sessions.json", "bench_cluster_sessions_seed1.json")
    ]
    for row in session_rows(seeds[0]):
        assert row in results, row

    def percent_range(values, digits=0):
        low, high = round(100 * min(values)), round(100 * max(values))
        return f"{low}-{high}%"

    def found(result, gib):
        return [p["hit_share_of_shareable"] for p in result["prefix_caching"] if p["gib_per_device"] == gib]

    assert f"finds {percent_range(found(seeds[0], 0.5))} of the history at 0.5 GiB per GPU" in flat
    assert f"({percent_range(found(seeds[1], 0.5))} with seed 1" in flat
    small = [percent_range(found(result, 0.125)) for result in seeds]
    assert f"and {small[0]} at 0.125 GiB ({small[1]} with seed 1)" in flat
    pairs = [p for result in seeds for p in result["prefix_caching"]]
    p50 = [1 - p["ttft_p50_ratio"] for p in pairs]
    p99 = [1 - p["ttft_p99_ratio"] for p in pairs]
    assert f"move TTFT p50 by {percent_range(p50)} and p99 by at most {round(100 * max(p99))}%" in flat
    for result in seeds:  # "and SLO attainment not at all": each run with the cache on beside its run off
        for off, on in zip(result["runs"][0::2], result["runs"][1::2]):
            assert not off["prefix_caching"] and on["prefix_caching"]
            assert on["slo_attainment"] == off["slo_attainment"]
    refused = [
        r["refused"] / result["turns"]
        for result in seeds
        for r in result["runs"]
        if r["gib_per_device"] == 0.125
    ]
    assert all(0.2 < share < 0.3 for share in refused)  # "about a quarter"
    first = seeds[0]["first_turn_prompt_tokens_mean"]
    later = seeds[0]["later_turn_prompt_tokens_mean"]
    assert f"{later:.0f} tokens on average, against {first:.0f} for a first turn" in flat
    stats = session_workloads()["lmsys_chat_1m"]
    means = f"{stats['prompt_mean']} new prompt tokens and {stats['output_mean']} output tokens a turn"
    assert f"({stats['turns_mean']} turns a session, {means}" in flat


def test_committed_projections_and_cluster_runs_name_the_model_the_code_sizes():
    """bench parallel's projections are what costs.real_shape_projections computes today, and the
    cluster runs name bench cluster's MODEL (the per-expert-K/V model of JetMoE-8B's shape), so a
    renamed or resized preset shows here."""
    from moekv_ref.apps.bench_cluster import MODEL
    from moekv_ref.costs import real_shape_projections

    parallel = json.loads((ROOT / "figures" / "bench_parallel.json").read_text(encoding="utf-8"))
    assert parallel["projections"] == real_shape_projections()
    assert MODEL == "jetmoe-8b-expert-kv"
    for name in ("bench_cluster.json", "bench_cluster_seed1.json", "bench_cluster_gamma.json"):
        result = json.loads((ROOT / "figures" / name).read_text(encoding="utf-8"))
        assert result["model"] == MODEL, name
        assert result["cost_model"]["name"].startswith(f"{MODEL} on "), name


def test_results_profile_shares_are_what_notebook_01_shows():
    """docs/results.md quotes two profiles of the engine's own work: a py-spy profile (about a sixth, its
    setting named) and notebook 01's `bench step --profile`: the scheduler's and the bookkeeping's
    shares in the notebook's committed table add up to the two percentages docs/results.md gives."""
    cells = json.loads((ROOT / "notebooks" / "01_why_a_kv_cache.ipynb").read_text(encoding="utf-8"))["cells"]
    table = next(
        "".join(o.get("text", ""))
        for c in cells
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if "bookkeeping (rest of the step)" in "".join(o.get("text", ""))
    )
    shares = [0, 0]  # dense, embedded
    for line in table.splitlines():
        if line.strip().startswith(("scheduler", "bookkeeping")):
            dense, embedded = (int(p.rstrip("%")) for p in re.findall(r"(\d+)%", line))
            shares = [shares[0] + dense, shares[1] + embedded]
    results = " ".join(RESULTS.read_text(encoding="utf-8").split())
    quoted = re.search(
        r"notebook 01 runs it on 16 sequences, where the scheduler and the bookkeeping are about a "
        r"sixth of a step: (\d+)% for the embedded model, (\d+)% for a dense one",
        results,
    )
    assert quoted, "docs/results.md's sentence on notebook 01's profile"
    assert [int(quoted[2]), int(quoted[1])] == shares  # dense, embedded
    assert all(14 <= share <= 20 for share in shares), shares  # "about a sixth"
    assert "about a sixth of a step in this run (a `py-spy` profile" in results


def test_reading_order_and_exercise_list_cover_every_notebook():
    """The glossary's reading order links every notebook, and the layout table's list of notebooks
    without an exercise (docs/design.md) is exactly those without an Exercise heading."""
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    glossary = (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
    order = glossary.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    assert all(f"../notebooks/{path.name}" in order for path in notebooks)
    without = [
        path.name[:2]
        for path in notebooks
        if not any("exercise" in heading.lower() for heading in _headings(path))
    ]
    layout = " ".join((DOCS / "design.md").read_text(encoding="utf-8").split("## Layout", 1)[1].split())
    if without:
        assert f"every notebook but {' and '.join(without)}" in layout, without
    else:
        assert "one at the end of every notebook," in layout


def test_notebook_03_names_the_sweeps_of_bench_memory_it_differs_from():
    """Notebook 03 sweeps smaller traces than `bench memory` (to finish in seconds) and says so: the
    JSON's numbers it quotes are the JSON's, and its own are what it printed."""
    cells = json.loads(
        (ROOT / "notebooks" / "03_fragmentation_and_paging.ipynb").read_text(encoding="utf-8")
    )["cells"]
    prose = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    printed = "".join(
        "".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
    )
    memory = json.loads((ROOT / "figures" / "bench_memory.json").read_text(encoding="utf-8"))
    by_size = {
        r["block_size"]: r["effective_utilization"]
        for r in memory["block_size_sweep"]["rows"]
        if r["design"] == "paged"
    }
    by_experts = {
        r["num_experts"]: r["effective_utilization"]
        for r in memory["num_experts_sweep"]["rows"]
        if r["design"] == "paged"
    }
    size_mine = re.search(r"plain pages keep ([0-9.]+) at P = 16, against ([0-9.]+) for these 8", prose)
    experts_mine = re.search(
        r"plain pages keep ([0-9.]+) at E = 128,\s+against ([0-9.]+) for these four", prose
    )
    assert size_mine and experts_mine, "notebook 03 no longer names bench memory's sweeps"
    assert size_mine.group(1) == f"{by_size[16]:.3f}" and experts_mine.group(1) == f"{by_experts[128]:.3f}"
    assert re.search(rf"\n\s+16\s+paged\s+[0-9.]+\s+{re.escape(size_mine.group(2))}\s", printed)
    assert re.search(rf"\n128\s+2\s+[0-9.]+\s+paged\s+{re.escape(experts_mine.group(2))}\s*\n", printed)


def test_notebook_05_crossovers_are_bench_eviction_s():
    """Notebook 05 projects recompute against swap on bench eviction's grid, so the crossovers it
    prints are the ones figures/bench_eviction.json holds."""
    cells = json.loads((ROOT / "notebooks" / "05_eviction.ipynb").read_text(encoding="utf-8"))["cells"]
    printed = "".join(
        "".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
    )
    projected = json.loads((ROOT / "figures" / "bench_eviction.json").read_text(encoding="utf-8"))[
        "projected"
    ]
    for key, value in projected.items():
        crossover = value["crossover_context"]
        said = crossover if crossover is not None else "never, up to 4096"
        assert f"{key} -> swap cheaper from context {said}\n" in printed, key


def test_notebook_07_placements_are_bench_parallel_s():
    """Notebook 07 compares expert placements on the same held-out text as bench parallel (its first
    8,192 tokens), so each row it prints is the JSON's: ranks touched and K/V imbalance."""
    cells = json.loads((ROOT / "notebooks" / "07_expert_parallelism.ipynb").read_text(encoding="utf-8"))[
        "cells"
    ]
    printed = "".join(
        "".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
    )
    placements = json.loads((ROOT / "figures" / "bench_parallel.json").read_text(encoding="utf-8"))[
        "expert_placements"
    ]
    for row in placements:
        touched = f"{row['ranks_touched_per_token_layer']:.3f}"
        imbalance = f"{row['kv_imbalance_max_over_mean']:.3f}"
        columns = rf"\s+{re.escape(touched)}\s+[0-9.]+\s+[0-9.]+\s+{re.escape(imbalance)}\s"
        pattern = rf"\n\s*{row['world_size']} {row['strategy']}" + columns
        assert re.search(pattern, printed), (row["world_size"], row["strategy"], touched, imbalance)


def _notebook_texts(name: str) -> tuple[str, str, str]:
    """(markdown, code, printed output) of a notebook, each cell's text joined; the markdown's line
    breaks folded into spaces, so that a phrase may wrap."""
    cells = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))["cells"]
    markdown = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    printed = "".join(
        "".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
    )
    return " ".join(markdown.split()), code, printed


def test_notebook_11_states_the_workloads_its_json_and_code_ran():
    """Notebook 11 states each workload in words before its table or figure: the cluster study's model,
    GPUs, requests, lengths, memory, SLOs and stated test (figures/reservation_study.json and bench
    reservation's code), the simulator-speed runs (figures/bench_cluster_speed.json, bench_cluster_scale.json) and
    the exercise's cluster; every number there is the JSON's or the code's."""
    from moekv_ref.apps.bench_simulator import SCALE_ROUTINGS, SPEED_MAX_NUM_SEQS
    from moekv_ref.course.exercise_11 import (
        EXERCISE_11_DEVICES,
        EXERCISE_11_GIB_PER_DEVICE,
        EXERCISE_11_PROMPT_TOKENS,
    )
    from moekv_ref.sim.cluster import BLOCK_SIZE, MODEL, pool_blocks

    markdown, code, _ = _notebook_texts("11_simulating_a_cluster.ipynb")
    assert re.findall(r"## (\d)\. ", markdown) == ["1", "2", "3", "4", "5", "6"]  # the sections split on
    # section 4's sessions: the workload stated is the code's and the data file's
    sessions = re.search(r'sample_sessions\("(\w+)", (\d+), seed=0, max_tokens=(\d+)\)', code).groups()
    rate, think = re.search(
        r"session_arrivals\(follows, rate=([\d.]+), think_seconds=([\d.]+)", code
    ).groups()
    pools = re.search(r"for blocks in \((\d+), (\d+)\):", code).groups()
    from moekv_ref.sim.workloads import session_workloads

    means = session_workloads()[sessions[0]]
    text = markdown.split("## 4.", 1)[1].split("## 5.", 1)[0]
    assert f"The workload: {sessions[1]} sessions" in text and f"cut to {int(sessions[2]):,}" in text
    assert (
        f"({means['turns_mean']} turns a session, {means['prompt_mean']} new prompt tokens and "
        f"{means['output_mean']} output tokens a turn)"
    ) in " ".join(text.split())
    assert f"at {float(rate):g} a second" in " ".join(text.split())
    assert f"think times of {float(think):g} s on average" in " ".join(text.split())
    assert f"pools of {pools[0]} and then {pools[1]} blocks a device" in " ".join(text.split())
    config = get_config(MODEL)
    L = config.num_hidden_layers
    E = config.num_attention_experts
    k = config.num_attention_experts_per_tok

    from moekv_ref.apps import bench_reservation

    study = _figure("reservation_study.json")
    design = study["design"]
    text = markdown.split("## 2.", 1)[1].split("## 3.", 1)[0]
    assert f"`{design['model']}`" in text and design["model"] == MODEL
    assert f"L = {L} layers, E = {E} attention experts, top-{k}" in text
    assert f"{config.kv_bytes_per_entry() // 1024} KiB per (token, layer, expert) entry" in text
    assert (
        f"{design['devices']} H200 GPUs, one expert of every layer per GPU" in text and design["devices"] == E
    )
    assert f"the requests**: {study['requests']:,} a run" in text
    assert (
        study["workload"] == "azure_conversation_2023"
        and "Azure LLM inference trace of 2023 (conversation)" in text
    )
    assert f"cut to {config.max_position_embeddings:,} tokens" in text
    assert f"at most {design['max_num_seqs']} run at once" in text
    assert f"the victim `{bench_reservation.VICTIM}`" in text
    assert (
        design["admission"] == "predicted_per_device" and "admits by the predicted peak on every GPU" in text
    )
    assert f"the fullest GPU uses at {design['memory_load']:g} of capacity" in text
    assert f"TTFT at most {study['scales']['ttft_slo_s']:g} s" in text
    assert f"at least {bench_reservation.TARGET:.0%} are good" in text
    warmup, cooldown = design["warmup_cooldown"]
    assert warmup == cooldown and f"the first and last {warmup:.0%} of arrivals" in text
    assert "at most 80%" in study["preregistered"]["gate"] and "at most 80% of the bound" in text
    assert "above 0.95" in study["preregistered"]["pass"] and "the interval's low end above 0.95" in text
    assert "under 1% of steps" in text and "under 2% of the modelled time" in text
    # every number of the reading is one the JSON's summary gives, as its table prints it
    reading = text.split("Reading it.", 1)[1]
    printed = set()
    for memory, row in study["summary"].items():
        printed.add(memory)
        for numbers in row["strategies"].values():
            ratio = numbers["over_clairvoyant"]
            if numbers["n"] >= 2:
                printed |= {f"{numbers['goodput_per_gpu_mean']:.2f}", f"{ratio['mean']:.3f}"}
                printed |= {f"{bound:.3f}" for bound in ratio["ci95"]}
                printed |= {
                    f"{numbers['fault_step_fraction_max']:.2%}",
                    f"{numbers['thrown_away_fraction_max']:.2%}",
                }
                printed.add(str(numbers["n"]))
    for row in study["victims_summary"].values():  # the victims, as the section's cell prints them
        for ratio in row["over_newest_first"].values():
            if ratio["n"] >= 2:
                printed |= {f"{ratio['mean']:.3f}", str(ratio["n"])}
                printed |= {f"{bound:.3f}" for bound in ratio["ci95"]}
    printed.add(f"{study['topic_s']:g}")
    printed |= set(re.findall(r"\d+%", study["preregistered"]["victims"]))  # the stated gain
    quoted = re.findall(r"\d+(?:\.\d+)?%?", reading.replace("at most 0.80 of the bound", ""))
    assert quoted and set(quoted) <= printed, set(quoted) - printed
    section1 = markdown.split("## 1.", 1)[1].split("## 2.", 1)[0]
    assert (
        f"at most {bench_reservation.MAX_CHUNK_TOKENS:,} tokens a quantile (q = {bench_reservation.QUANTILE:g})"
        in section1
    )
    assert (
        design["quantile"] == bench_reservation.QUANTILE
        and design["max_chunk_tokens"] == bench_reservation.MAX_CHUNK_TOKENS
    )

    speed = json.loads((ROOT / "figures" / "bench_cluster_speed.json").read_text(encoding="utf-8"))
    scale = json.loads((ROOT / "figures" / "bench_cluster_scale.json").read_text(encoding="utf-8"))
    text = markdown.split("## 3.", 1)[1].split("## 4.", 1)[0]
    coarse, fine = speed["shapes"]
    assert f"{coarse['requests']:,} requests of a synthetic trace" in text
    assert f"mean prompt {speed['mean_prompt']} and output {speed['mean_output']} tokens" in text
    assert f"at most {SPEED_MAX_NUM_SEQS} running" in text and speed["threads"] == 1 and "one thread" in text
    assert speed["victim"] == "sequence_lru"
    for row in (coarse, fine):
        assert (
            f"L = {row['layers']} layers of E = {row['experts']} experts, top-{row['top_k']}, on "
            f"{row['devices']} devices of {row['blocks_per_device']:,} blocks each"
        ) in text
    assert fine["this"]["requests_per_second"] < coarse["this"]["requests_per_second"]  # "the slower one"
    assert f"writes {fine['top_k']} rows a layer instead of {coarse['top_k']}" in text
    assert f"tracks {fine['devices']} devices" in text
    assert (scale["layers"], scale["experts"], scale["top_k"], scale["devices"]) == (
        fine["layers"],
        fine["experts"],
        fine["top_k"],
        fine["devices"],
    )
    assert f"second shape on {scale['requests']:,} requests" in text
    assert scale["threads"] == 2 and "two threads" in text
    assert scale["distinct_routings"] == SCALE_ROUTINGS and f"a bank of {SCALE_ROUTINGS:,} routings" in text

    text = markdown.split("## 5.", 1)[1]
    assert (
        f"L = {L} layers of E = {E} attention experts, top-{k}, on {EXERCISE_11_DEVICES} GPUs that each "
        f"hold one expert of every layer, blocks of {BLOCK_SIZE} tokens"
    ) in text
    assert f"a prompt of {EXERCISE_11_PROMPT_TOKENS:,} tokens" in text
    assert (
        f"{EXERCISE_11_GIB_PER_DEVICE:g} GiB of KV memory per GPU is "
        f"{pool_blocks(EXERCISE_11_GIB_PER_DEVICE):,} blocks"
    ) in text

    # section 1's workload: the numbers the prose gives that the printed line does not are the code's
    assert "mean_prompt=32, mean_output=128, topic_s=1.5" in code and "max_num_seqs=16" in code
    text = markdown.split("## 1.", 1)[1].split("## 2.", 1)[0]
    assert "means of 32 prompt and 128 output tokens" in text and "(topic skew 1.5)" in text
    assert "at most 16 requests run at once" in text


def test_readme_notebook_table_lists_every_notebook_and_its_total_is_the_sum():
    """The README's table of notebooks has one row per notebook, in order, each with a time, and the
    sentence under it gives their sum in minutes (and the hours it rounds to)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\d\d_\w+)` \| .+ \| about (\d+) min \|$", readme, re.M)
    assert [name for name, _ in rows] == [path.stem for path in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    total = sum(int(minutes) for _, minutes in rows)
    words = " ".join(readme.split())
    said = re.search(r"(nearly|over|about) (\d+) hours for the course, (\d+) minutes in all", words)
    assert said and int(said[3]) == total, (said and said.groups(), total)
    hours = int(said[2])
    assert {"nearly": hours - 1 < total / 60 < hours, "over": hours < total / 60 < hours + 0.5}.get(
        said[1], abs(total / 60 - hours) <= 0.25
    ), (said.groups(), total)


def test_readme_public_api_example_runs_as_written_and_writes_text(capsys):
    """The README's public-API block, run as written: at temperature 0 the embedded model once
    answered its prompts with nothing but spaces. Every continuation it makes (the static batch, the
    engine's, the budgeted one, the engine's own requests) holds more than whitespace, and the
    continuations it prints are the static batch's."""
    pytest.importorskip("triton")  # the block loads the model on the Triton backend too
    from moekv_ref.prompts import decode

    block = re.search(r"## The public API\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    names = {}
    exec(compile(block.group(1), "README.md", "exec"), names)
    texts = [decode(t) for t in names["result"].tokens + names["same"].tokens + names["capped"].tokens]
    texts += [decode(output.token_ids) for output in names["outputs"]]
    assert len(texts) == 7 and all(text.strip() for text in texts), texts
    assert names["same"].tokens == names["result"].tokens
    printed = capsys.readouterr().out
    assert printed == f"{[decode(t) for t in names['result'].tokens]}\n"


def test_results_parallel_failure_times_are_the_default_timeouts():
    """docs/results.md's promise of how soon every rank exits after a fault: within 30 s once every rank
    has joined (a collective's timeout, then the settle and the grace), but a fault during start-up
    waits out the start timeout, so about 125 s there."""
    from moekv_ref.parallel import launcher
    from moekv_ref.parallel.comm import SETTLE_S

    text = " ".join(RESULTS.read_text().split())
    after = SETTLE_S + launcher.DEFAULT_GRACE_S
    start = launcher.DEFAULT_START_TIMEOUT_S
    sentence = (
        f"at the default timeouts within 30 s once every rank has joined the process group "
        f"({launcher.DEFAULT_TIMEOUT_S:g} s per collective, then {after:g} s to settle and end the others), "
        f"and within about {start + after:g} s when a rank hangs or stops during start-up, before every "
        f"rank has joined (the {start:g} s start timeout, then up to {after:g} s more)."
    )
    assert sentence in text
    assert launcher.DEFAULT_TIMEOUT_S + after <= 30


def _figure(name: str) -> dict:
    return json.loads((ROOT / "figures" / name).read_text(encoding="utf-8"))


def findings_phrases() -> list[str]:
    """Every phrase of the README's "What it finds" that holds a number, each number computed from
    its committed JSON in figures/ (with what the words around it claim checked there too)."""
    memory = _figure("bench_memory.json")["workloads"]["W2"]
    trace = memory["workload"]
    paged, tails, first_fit, reserved = (
        memory[design] for design in ("paged", "paged_shared_tail", "first_fit", "reserved")
    )
    parallel = _figure("bench_parallel.json")
    context = max(parallel["kv_with_sequence_over_kv_with_expert"], key=int)
    eviction = [_figure(name) for name in ("bench_eviction.json", "bench_eviction_swap.json")]
    rates = [p["tokens_per_step"] for run in eviction for p in run["workload"]["policies"].values()]
    extra = [
        100 * (i["optimum"]["worst_steps"] / i["optimum"]["steps"] - 1)
        for i in _figure("eviction_optimum.json")["instances"]
    ]
    prefix = eviction[0]["prefix_cache"]
    topk = prefix["routings"]["topk"]
    assert topk["outputs_equal"]  # "with the same outputs"
    study = _figure("reservation_study.json")
    family = _figure("family.json")["variants"]
    gaps = ", ".join(
        f"{family['expert_topk']['bits_per_byte_mean'] - family[name]['bits_per_byte_mean']:.2f}"
        for name in ("dense", "dense_kv_matched")
    )
    flops = family["expert_topk"]["bits_per_byte_mean"] - family["dense_flops_matched"]["bits_per_byte_mean"]
    capacity = {
        (r["variant"], r["policy"], r["budget_tokens"]): r["bits_per_byte_mean"]
        for r in _figure("capacity.json")["table"]
    }
    serving = _figure("bench_serving_budget.json")
    designs = serving["designs"]
    requests = serving["workload"]["num_requests"]
    assert designs["continuous_reserved + budget"]["refused"] == 0  # "serve all"
    speedup = (
        designs["continuous_reserved + budget"]["tokens_per_second"]
        / designs["continuous_reserved"]["tokens_per_second"]
    )
    peer = _figure("bench_peer.json")["paths"]["paged"]
    assert peer["identical_tokens"]  # "gives its tokens exactly"
    return [
        f"a trace of {trace['num_experts']} attention experts, top-{trace['top_k']}",
        f"{paged['effective_utilization']:.1%} of the bytes it holds are live K/V",
        f"({tails['effective_utilization']:.1%} with shared tails)",
        f"against {first_fit['effective_utilization']:.1%} for first-fit buffers and "
        f"{reserved['effective_utilization']:.1%} for reserving",
        f"in the same memory {paged['max_concurrent_sequences']} requests run at once, against "
        f"{first_fit['max_concurrent_sequences']} and {reserved['max_concurrent_sequences']}",
        f"{parallel['world_size']} CPU ranks",
        f"moves {round(parallel['kv_with_sequence_over_kv_with_expert'][context])}x the bytes",
        f"at a context of {context}",
        f"differ by at most {100 * (max(rates) / min(rates) - 1):.1f}%",
        f"takes {round(min(extra))}-{round(max(extra))}% more steps",
        f"{prefix['num_requests']} requests whose first {prefix['shared_len']} of {prefix['prompt_len']} tokens",
        f"skip {topk['token_hit_rate']:.1%} of their prompt tokens",
        f"serve {topk['tokens_per_second_ratio']:.2f}x the tokens/s",
        f"`bench reservation`, {study['design']['devices']} GPUs",
        f"{study['requests']:,} requests a run",
        bench_reservation.headline(study, 0.125),
        bench_reservation.verdict(study, 0.125),
        bench_reservation.victims_verdict(study, 0.125),
        f"by {gaps} and {flops:.2f} bits per byte",
        f"newest 16 tokens costs the routed model {capacity['expert_topk', 'window', 16]:.3f} against "
        f"{capacity['expert_topk', 'none', None]:.3f} bits per byte",
        f"a window of {serving['budget']['max_tokens']} tokens a row",
        f"serve all {requests} requests, not {requests - designs['continuous_reserved']['refused']}",
        f"at {speedup:.1f}x the tokens/s",
        f"decodes {peer['ratio_vs_hf']:.2f}x the tokens/s",
    ]


def test_readme_findings_are_what_their_json_says():
    """The README's few lines of findings: each phrase with a number is computed from its JSON, and
    no number stands there outside those phrases (a number added by hand fails)."""
    readme = README.read_text(encoding="utf-8")
    section = readme.split("\n## What it finds\n", 1)[1].split("\n## ", 1)[0]
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    assert 5 <= len(bullets) <= 8, bullets
    text = " ".join(LINK.sub(r"\1", section).split())  # link targets dropped, lines folded
    for phrase in findings_phrases():
        assert phrase in text, phrase
        text = text.replace(phrase, " ")
    assert not re.search(r"\d", text), re.findall(r".{30}\d.{30}", text)


def test_readme_is_a_front_door():
    """README.md stays short and in its order: what it is and for whom, the two commands (the
    demo's and the tests'), the notebooks, the findings, the files of one decode token, the API,
    then links; the benchmarks' tables live in docs/results.md."""
    readme = README.read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 218  # the front door, with the map of each option's class
    order = [
        "Python 3.11 or newer and PyTorch basics",
        "No GPU is\nneeded",
        "\n```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt "
        "&& python -m moekv_ref demo\n```\n",
        "On Windows, activate with `.venv\\Scripts\\activate`",
        "What runs where:",
        "\n```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt "
        "&& python -m pytest\n```\n",
        "\n## Start here: open notebook 01\n",
        "jupyter trust notebooks/*.ipynb && jupyter lab",
        "\n## What it finds\n",
        "\n## One decode token, file by file\n",
        "\n## The public API\n",
        "\n## Read on\n",
    ]
    places = [readme.find(text) for text in order]
    assert -1 not in places, [text for text, at in zip(order, places) if at == -1]
    assert places == sorted(places), order
    for core in (
        "model.py",
        "attention.py",
        "cache/paged.py",
        "cache/kv_cache_manager.py",
        "cache/block_pool.py",
        "engine/scheduler.py",
        "engine/engine.py",
    ):
        assert f"`moekv_ref/{core}`" in readme.split("## One decode token", 1)[1], core
    links = [target for _, target in LINK.findall(readme.split("\n## Read on\n", 1)[1])]
    assert links[:4] == ["docs/results.md", "docs/design.md", "docs/glossary.md", "notebooks/"], links
    assert "| placement |" not in readme and "| policy |" not in readme  # tables live in results.md


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _page_anchors(page: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def test_every_link_to_a_section_names_a_heading():
    """A link `page.md#section` (or `#section` on its own page) names a heading of that page, as
    GitHub spells its anchors; the README's links into docs/ and docs/results.md's contents too."""
    assert _slug("A budget per row (`capacity`, `bench serving --budget`)") == (
        "a-budget-per-row-capacity-bench-serving---budget"
    )
    unknown = []
    for page in PAGES:
        for _, target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://", target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            linked = (page.parent / path).resolve() if path else page
            if linked.suffix == ".md" and anchor not in _page_anchors(linked):
                unknown.append(f"{page.name}: {target}")
    assert not unknown, unknown


def test_the_robustness_check_in_the_results_is_its_json():
    """docs/results.md's x3 / x10 table is robustness_table of the three committed studies (each run
    from a clean commit, at the step-time scale its name says), and every number of the prose under
    it is one the table prints."""
    studies = {1: _figure("reservation_study.json")}
    for scale in (3, 10):
        study = _figure(f"reservation_study_x{scale}.json")
        assert study["time_scale"] == scale and study["scales"]["cost_model"].endswith(f"x {scale}")
        assert study["commits"] and not any(commit.endswith("-dirty") for commit in study["commits"])
        assert all(task["commit"] in study["commits"] for task in study["tasks"].values())
        studies[scale] = study
    text = RESULTS.read_text(encoding="utf-8")
    table = bench_reservation.robustness_table(studies)
    assert table in text
    section = text.split("### Robustness: every step time x3 and x10", 1)[1].split("\n## ", 1)[0]
    prose = section.split(table, 1)[1]
    quoted = set(re.findall(r"\d+\.\d+", prose))
    assert quoted and quoted <= set(re.findall(r"\d+\.\d+", table)), quoted
    for scale in (3, 10):
        assert f"--time-scale {scale} --json figures/reservation_study_x{scale}.json" in text


def test_the_reservation_study_in_the_results_is_its_json():
    """docs/results.md's reservation section: its status line and tables are bench_reservation's of
    the committed JSON, whose runs all came from a commit with no uncommitted changes."""
    study = _figure("reservation_study.json")
    text = RESULTS.read_text(encoding="utf-8")
    assert bench_reservation.status_line(study) in text
    assert bench_reservation.markdown_tables(study) in text
    assert study["commits"] and not any(commit.endswith("-dirty") for commit in study["commits"])
    assert all(task["commit"] in study["commits"] for task in study["tasks"].values())
    assert (ROOT / "figures" / "reservation_study.png").exists()
    # every number of its reading is one its tables print (or the quantile the design states)
    reading = text.split("What it says.", 1)[1].split("Not run yet", 1)[0]
    tables = bench_reservation.markdown_tables(study)
    allowed = set(re.findall(r"\d+(?:\.\d+)?%?", tables)) | {f"{study['design']['quantile']:g}"}
    quoted = re.findall(r"\d+(?:\.\d+)?%?", reading)
    assert quoted and set(quoted) <= allowed, set(quoted) - allowed
