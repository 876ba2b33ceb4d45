"""The numbers a notebook's text quotes are the numbers its own cells print.

The browser test (or nbval) checks that every stored output is what a fresh run prints; these tests
check that the prose beside it says what the stored output says, so neither can drift alone: each
test reads a number out of a markdown cell and the same number out of an output, and compares them.
(docs/results.md's tables, the README's findings and notebooks 07 and 09's prose are tied to the
benchmarks' JSON in test_docs.py, test_family.py and test_capacity.py.)
"""

import inspect
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _texts(name: str) -> tuple[str, str]:
    """(all markdown, all printed output) of a notebook, each cell's text joined (a cell's output
    streams as one); the markdown's line breaks folded into spaces, so a phrase may wrap."""
    cells = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))["cells"]
    markdown = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    printed = "\n".join(  # a cell's streams joined as printed (a slow loop's lines come in several)
        "".join("".join(o.get("text", "")) for o in c.get("outputs", []) if o.get("output_type") == "stream")
        for c in cells
        if c["cell_type"] == "code"
    )
    return re.sub(r"\s+", " ", markdown), printed


def _number(pattern: str, text: str, what: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{what}: {pattern!r} not found"
    return float(match[1].replace(",", ""))


def _table(printed: str, header: str) -> list[list[str]]:
    """Rows (split on runs of spaces) of the printed table whose header line starts with `header`."""
    lines = printed.split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    rows = []
    for line in lines[start + 1 :]:
        if set(line.strip()) <= {"-", " "} and line.strip():  # the rule under the header
            continue
        if not line.strip() or (rows and len(line.split()) != len(rows[0])):
            break  # the table has ended
        rows.append(line.split())
    return rows


def test_notebook_03_quotes_its_tables():
    markdown, printed = _texts("03_fragmentation_and_paging.ipynb")
    designs = {(r[0], r[1]): r for r in _table(printed, "design")}
    assert _number(
        r"at P = 16 most of a row's single block is empty \(effective ([\d.]+)\)", markdown, "P=16"
    ) == float(designs["paged", "16"][3])
    assert _number(r"and at P = 4 much less \(([\d.]+)\)", markdown, "P=4") == float(designs["paged", "4"][3])
    assert _number(r"It gets less, ([\d.]+), because", markdown, "reserved") == float(
        designs["reserved", "-"][3]
    )
    assert _number(r"can never exceed \$k/E\$ = ([\d.]+)", markdown, "k/E") == _number(
        r"k/E = \d+/\d+ = ([\d.]+)", printed, "k/E printed"
    )
    tokens_per_row = _number(r"a row ends holding ([\d.]+) tokens on average", printed, "tokens per row")
    assert _number(r"Rows here end with only about (\d+) tokens", markdown, "tokens per row") == round(
        tokens_per_row
    )
    by_experts = {(r[0], r[3]): r for r in _table(printed, "E  k")}
    assert _number(r"so plain pages keep ([\d.]+) here", markdown, "E=8") == float(
        by_experts["8", "paged"][4]
    )
    assert _number(r"against ([\d.]+) there", markdown, "section 2") == float(designs["paged", "16"][3])


def test_notebook_04_quotes_its_summary():
    markdown, printed = _texts("04_continuous_batching.ipynb")
    held = _number(r"blocks held at the end, all requests\s+(\d+)", printed, "blocks held")
    share = _number(r"pool / that sum\s+([\d.]+)", printed, "pool share")
    pool = _number(r"The pool has (\d+) blocks of 16 slots", markdown, "pool")
    assert _number(r"of the ([\d,]+) blocks the twenty requests hold", markdown, "held") == held
    assert (
        _number(r"slots: (\d+)% of the", markdown, "share") == round(100 * share) == round(100 * pool / held)
    )
    assert _number(r"requests admitted\s+(\d+)", printed, "admitted") == 20  # "Twenty requests"
    assert _number(r"requests refused\s+(\d+)", printed, "refused") == 1  # "the twenty-first"


def test_notebook_05_quotes_its_tables():
    markdown, printed = _texts("05_eviction.ipynb")
    # the workload, in words before the first figure, is the one the cell printed
    shape = re.search(
        r"(\d+) sequences, L = (\d+) layers, E = (\d+) experts, top-(\d+), (\d+) devices", printed
    ).groups()
    sequences, layers, experts, top_k, devices = (int(n) for n in shape)
    assert sequences == 20  # "Twenty sequences"
    assert (
        f"through L = {layers} layers of E = {experts} attention experts each, top-{top_k} (every token goes "
        f"to {top_k} of a layer's {experts} experts). The experts of every layer are spread over {devices} "
        "devices"
    ) in markdown
    policies = {r[0]: r for r in _table(printed, "policy") if r[0] != "bound"}
    evicting = [p for p in policies.values() if int(p[6]) > 0]
    goodputs = [float(p[3]) for p in evicting]
    assert 100 * (max(goodputs) / min(goodputs) - 1) < _number(
        r"evict are within (\d+)% of each other", markdown, "spread"
    )
    evictions = [int(p[6]) for p in evicting]
    assert all(abs(e - 10) <= 2 for e in evictions), evictions  # "about ten evictions"
    freed = [
        float(p[8]) for name, p in policies.items() if name in ("sequence_lru", "pressure_aware", "belady")
    ]
    assert all(
        abs(f - _number(r"a whole sequence frees about (\d+) there", markdown, "freed")) < 1.5 for f in freed
    )
    assert float(policies["expert_lru"][8]) == 1.0  # "frees one block there"
    assert int(policies["oracle"][1]) == max(int(p[1]) for p in policies.values())  # "the most steps"

    # recompute or swap: the text's range is the printed one
    horizon = _number(r"swap cheaper from context never, up to (\d+)", printed, "PCIe horizon")
    assert _number(r"than to recompute, within (\d+) tokens", markdown, "PCIe horizon") == horizon

    # the exact optimum
    rows = _table(printed, "instance")
    names = ["sequence_lru", "expert_lru", "pressure_aware", "oracle", "belady"]
    instances = [dict(zip(["optimum"] + names + ["worst"], map(int, r[6:13]))) for r in rows]
    spread = max(100 * (i["worst"] / i["optimum"] - 1) for i in instances)
    assert round(spread) == _number(
        r"up to (\d+)% more steps between the best and the worst", markdown, "spread"
    )
    worst_for_lru = sum(i["sequence_lru"] == i["worst"] for i in instances)
    assert re.search(
        rf"worst schedule of all on {['no', 'one', 'two', 'three', 'four'][worst_for_lru]} of the four",
        markdown,
    ), worst_for_lru
    first, last = instances[0], instances[-1]
    assert last["pressure_aware"] == last["optimum"]  # "matches the optimum on the last"
    above = 100 * (first["pressure_aware"] / first["optimum"] - 1)
    assert round(above) == _number(r"is (\d+)% above it on the first", markdown, "pressure_aware")
    assert last["belady"] == last["worst"]  # "the worst schedule on the last one"
    online = ["sequence_lru", "expert_lru", "pressure_aware"]
    closest = sum(i["belady"] <= min(i[n] for n in online) for i in instances[:-1])
    assert closest == 3  # "closest ... on three instances"


def test_notebook_07_states_the_placement_workload_it_runs():
    """Section 4's workload in words: the embedded model's shape, the tokens it routes and the rank
    counts of the cell that runs it."""
    from moekv_ref.checkpoint import load_default_model
    from moekv_ref.parallel.locality import attention_routing_of_text

    markdown, _ = _texts("07_expert_parallelism.ipynb")
    cells = json.loads((NOTEBOOKS / "07_expert_parallelism.ipynb").read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    config = load_default_model().config
    tokens = inspect.signature(attention_routing_of_text).parameters["max_tokens"].default
    assert (
        f"the embedded model ({config.num_hidden_layers} layers, {config.num_attention_experts} attention "
        f"experts each, top-{config.num_attention_experts_per_tok}) routing the first {tokens:,} tokens"
        in markdown
    )
    sizes = re.search(r"compare_placements\(routing_of_text, world_sizes=\((\d+), (\d+)\)", code).groups()
    assert f"placed on {sizes[0]} and then {sizes[1]} ranks" in markdown


def test_notebook_11_quotes_its_tables():
    markdown, printed = _texts("11_simulating_a_cluster.ipynb")
    # section 1: the workload stated is the one printed
    shape = re.search(
        r"(\d+) requests, L = (\d+) layers, E = (\d+) experts, top-(\d+), (\d+) devices of (\d+) blocks of "
        r"(\d+) slots",
        printed,
    ).groups()
    requests, layers, experts, top_k, devices, blocks, slots = (int(n) for n in shape)
    assert (
        f"notebook 05's: {requests} requests, all waiting from the start (no arrival rate)" in markdown
        and f"L = {layers} layers of E = {experts} attention experts, top-{top_k}" in markdown
        and f"by co-activation on {devices} devices" in markdown
        and f"a pool of {blocks} blocks of {slots} slots" in markdown
    )
    # section 1's reading: "the bound finishes first. Worst-case reservation never runs short, ... it takes
    # the longest. Optimistic reservation runs short and retries, and ... the work it throws away costs
    # less than the memory it frees. Calibrated reservation ... never runs short here, and gets part of
    # the way to the bound"
    rows = {r[0]: r for r in _table(printed, "reservation steps")}
    assert list(rows) == ["worst_case", "optimistic", "calibrated", "clairvoyant"]
    seconds = {name: float(r[6]) for name, r in rows.items()}
    short = {name: int(r[3]) for name, r in rows.items()}
    thrown = {name: float(r[4].removesuffix("ms")) for name, r in rows.items()}
    assert "the bound finishes first" in markdown and min(seconds, key=seconds.get) == "clairvoyant"
    assert "Worst-case reservation never runs short" in markdown and short["worst_case"] == 0
    assert "it takes the longest" in markdown and max(seconds, key=seconds.get) == "worst_case"
    assert "Optimistic reservation runs short and retries" in markdown
    assert (
        short["optimistic"] > 0 and thrown["optimistic"] > 0 and seconds["optimistic"] < seconds["worst_case"]
    )
    assert "never runs short here, and gets part of the way to the bound" in markdown
    assert short["calibrated"] == 0 == thrown["calibrated"]
    assert seconds["clairvoyant"] < seconds["calibrated"] < seconds["worst_case"]
    # section 4: "with room to spare (640 blocks a device) the later turns find most of their history
    # and their mean TTFT falls; with 240 blocks ... little is found, and the longest turns are refused"
    rows = {(r[0], r[1]): r for r in _table(printed, "blocks prefix cache")}
    roomy, tight = sorted({int(blocks) for blocks, _ in rows}, reverse=True)
    assert "with room to spare (640 blocks a device)" in " ".join(markdown.split()) and roomy == 640
    assert f"with {tight} blocks the pools hand most idle blocks" in " ".join(markdown.split())

    def found(blocks):
        return float(rows[str(blocks), "on"][2].rstrip("%")) / 100

    def ttft(blocks, cache):
        return float(rows[str(blocks), cache][4].removesuffix("ms"))

    assert found(roomy) > 0.5 and ttft(roomy, "on") < ttft(roomy, "off")
    assert found(tight) < 0.25 and int(rows[str(tight), "on"][3]) > 0 == int(rows[str(roomy), "on"][3])


@pytest.mark.parametrize(
    "name",
    [
        "03_fragmentation_and_paging.ipynb",
        "04_continuous_batching.ipynb",
        "05_eviction.ipynb",
        "11_simulating_a_cluster.ipynb",
    ],
)
def test_a_changed_output_is_caught(name, monkeypatch):
    """The checks above fail when a stored number changes: each notebook's first quoted number is
    altered in its output and the notebook's test must raise."""
    original = _texts(name)
    altered = {
        "03_fragmentation_and_paging.ipynb": ("0.556", "0.566"),
        "04_continuous_batching.ipynb": ("1289", "1298"),
        "05_eviction.ipynb": ("never, up to 4096", "never, up to 1024"),
        "11_simulating_a_cluster.ipynb": ("   0.53   0.822", "   0.53   0.922"),
    }[name]
    assert altered[0] in original[1]
    monkeypatch.setitem(globals(), "_texts", lambda n: (original[0], original[1].replace(*altered)))
    test = {
        "03_fragmentation_and_paging.ipynb": test_notebook_03_quotes_its_tables,
        "04_continuous_batching.ipynb": test_notebook_04_quotes_its_summary,
        "05_eviction.ipynb": test_notebook_05_quotes_its_tables,
        "11_simulating_a_cluster.ipynb": test_notebook_11_quotes_its_tables,
    }[name]
    with pytest.raises(AssertionError):
        test()
