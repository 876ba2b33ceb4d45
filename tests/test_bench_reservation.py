"""`bench reservation` (apps/bench_reservation.py): the verdict it states before its runs is the one it
computes from them, its intervals are Student-t intervals, and a result never comes from a tree with
uncommitted changes."""

import json
import math
import random

import pytest

from moekv_ref import jsonout
from moekv_ref.apps import bench_reservation, cli
from moekv_ref.plots.reservation import plot_reservation
from moekv_ref.stats import mean_ci95, t_quantile_975


def synthetic_result(ratios: dict, faults: float = 0.001, thrown: float = 0.005, seeds: int = 10) -> dict:
    """Tasks whose goodput per GPU is ratios[strategy](seed) times clairvoyant's (10 + seed)."""
    tasks = {}
    for memory in bench_reservation.MEMORY:
        for seed in range(seeds):
            for strategy in bench_reservation.STRATEGIES:
                bound = 10.0 + seed
                ratio = 1.0 if strategy == "clairvoyant" else ratios[strategy](seed)
                tasks[bench_reservation.task_key(strategy, "newest_first", memory, seed)] = {
                    "strategy": strategy,
                    "victim": "newest_first",
                    "memory": memory,
                    "seed": seed,
                    "goodput_per_gpu": bound * ratio,
                    "fault_step_fraction": faults if strategy == "calibrated" else 0.0,
                    "thrown_away_fraction": thrown if strategy == "calibrated" else 0.0,
                }
    return {"tasks": tasks, "seeds": seeds}


def steady(value):
    return lambda seed: value + (0.004 if seed % 2 else -0.004)


def test_r_passes_where_the_gate_binds_and_calibrated_stays_within_five_percent_of_the_bound():
    result = synthetic_result(
        {"worst_case": steady(0.7), "optimistic": steady(0.8), "calibrated": steady(0.98)}
    )
    for row in bench_reservation.summarize(result).values():
        assert row["gate_binds"] and row["R_passes"] is True and row["complete"]
        ratio = row["strategies"]["calibrated"]["over_clairvoyant"]
        assert ratio["n"] == 10 and ratio["ci95"][0] > 0.95
        assert row["calibrated_over_worst_case"]["mean"] == pytest.approx(0.98 / 0.7, rel=1e-3)


@pytest.mark.parametrize(
    "calibrated,faults,thrown",
    [
        (lambda seed: 0.96 + (0.03 if seed % 2 else -0.03), 0.001, 0.005),  # mean above 0.95, CI not
        (steady(0.98), 0.02, 0.005),  # faults on 2% of steps
        (steady(0.98), 0.001, 0.03),  # 3% of modelled time thrown away
    ],
    ids=["interval", "faults", "thrown-away"],
)
def test_r_fails_on_any_one_of_its_three_conditions(calibrated, faults, thrown):
    result = synthetic_result(
        {"worst_case": steady(0.7), "optimistic": steady(0.8), "calibrated": calibrated}, faults, thrown
    )
    for row in bench_reservation.summarize(result).values():
        assert row["gate_binds"] and row["R_passes"] is False


def test_r_has_no_verdict_where_worst_case_is_within_80_percent_of_the_bound():
    result = synthetic_result(
        {"worst_case": steady(0.9), "optimistic": steady(0.8), "calibrated": steady(0.98)}
    )
    for row in bench_reservation.summarize(result).values():
        assert not row["gate_binds"] and row["R_passes"] is None


def test_a_study_missing_seeds_is_marked_incomplete():
    result = synthetic_result(
        {"worst_case": steady(0.7), "optimistic": steady(0.8), "calibrated": steady(0.98)}
    )
    del result["tasks"][
        bench_reservation.task_key("optimistic", "newest_first", bench_reservation.MEMORY[0], 3)
    ]
    rows = bench_reservation.summarize(result)
    assert not rows[f"{bench_reservation.MEMORY[0]:g}"]["complete"]
    assert rows[f"{bench_reservation.MEMORY[0]:g}"]["strategies"]["optimistic"]["n"] == 9
    assert rows[f"{bench_reservation.MEMORY[0]:g}"]["strategies"]["worst_case"]["n"] == 9  # the paired seeds


def test_the_t_quantile_matches_the_table_and_the_interval_covers_as_it_should():
    """Table values at 1, 9 and 30 degrees of freedom, the expansion within 0.001 of the published
    2.000 (60) and 1.980 (120); and over 4,000 fresh samples of 5 normal values, the interval
    covers the mean in 95% of them (within 1.5 points)."""
    assert (t_quantile_975(1), t_quantile_975(9), t_quantile_975(30)) == (12.706, 2.262, 2.042)
    assert t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)
    assert t_quantile_975(120) == pytest.approx(1.980, abs=1e-3)
    rng = random.Random(20261207)
    covered = 0
    for _ in range(4000):
        interval = mean_ci95([rng.gauss(3.0, 2.0) for _ in range(5)])["ci95"]
        covered += interval[0] <= 3.0 <= interval[1]
    assert abs(covered / 4000 - 0.95) < 0.015
    assert math.isnan(mean_ci95([1.0])["ci95"][0]) and mean_ci95([])["n"] == 0


def test_a_tree_with_uncommitted_changes_gives_no_result(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonout, "source_commit", lambda: "abc1234-dirty")
    path = tmp_path / "study.json"
    args = cli.build_parser().parse_args(["bench", "reservation", "--json", str(path)])
    with pytest.raises(ValueError, match="uncommitted changes"):
        bench_reservation.main(args)
    assert not path.exists()


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--seeds", "0"], "--seeds=0"),
        (["--requests", "99"], "--requests=99"),
        (["--workers", "0"], "--workers=0"),
        (["--json", "/dev/null/x.json"], "/dev/null"),
        (["--topic-s", "-1"], "--topic-s=-1"),
        (["--time-scale", "0"], "--time-scale=0"),
        (["--memory", "0.25"], "--memory=0.25"),
    ],
)
def test_bad_options_are_refused_by_name(argv, named):
    args = cli.build_parser().parse_args(["bench", "reservation", *argv])
    with pytest.raises(ValueError, match=named):
        bench_reservation.check_args(args)


def victims_result(gains: dict, seeds: int = 10) -> dict:
    """Calibrated-reservation tasks whose goodput is newest_first's (10 + seed) times gains[victim](seed)."""
    tasks = {}
    for memory in bench_reservation.MEMORY:
        for seed in range(seeds):
            for victim in ("newest_first", *gains):
                gain = 1.0 if victim == "newest_first" else gains[victim](seed)
                tasks[bench_reservation.task_key("calibrated", victim, memory, seed)] = {
                    "strategy": "calibrated",
                    "victim": victim,
                    "memory": memory,
                    "seed": seed,
                    "goodput_per_gpu": (10.0 + seed) * gain,
                }
    design = {"strategies": ["calibrated"], "victims": ["newest_first", *gains]}
    return {"tasks": tasks, "seeds": seeds, "design": design}


@pytest.mark.parametrize(
    "gains,gains_10,within_3",
    [
        ({"pressure_aware": steady(1.15), "expert_lru": steady(0.9)}, True, False),
        ({"pressure_aware": steady(1.08), "expert_lru": steady(0.9)}, False, False),
        ({"pressure_aware": steady(1.02), "expert_lru": steady(0.99)}, False, True),
        ({"pressure_aware": lambda seed: 1.12 + (0.2 if seed % 2 else -0.2)}, False, False),  # CI holds 1
    ],
    ids=["gains", "too-little", "all-within", "interval"],
)
def test_the_victims_verdict_pieces_are_the_stated_ones(gains, gains_10, within_3):
    for row in bench_reservation.summarize_victims(victims_result(gains)).values():
        assert row["best_device_aware_gains_10_percent"] is gains_10
        assert row["all_within_3_percent"] is within_3
        assert all(ratio["n"] == 10 for ratio in row["over_newest_first"].values())


def test_a_file_from_before_victims_were_named_resumes_as_newest_firsts(tmp_path, monkeypatch):
    """Tasks keyed strategy|memory|seed read as newest_first's, so that a run given that file takes up
    only the missing tasks; a file of another setting is refused."""
    old = synthetic_result({"worst_case": steady(0.7), "optimistic": steady(0.8), "calibrated": steady(0.98)})
    old["tasks"] = {
        f"{t['strategy']}|{t['memory']:g}|{t['seed']}": {k: v for k, v in t.items() if k != "victim"}
        for t in old["tasks"].values()
    }
    keyed = bench_reservation.keyed_by_victim(old["tasks"])
    assert set(keyed) == {
        bench_reservation.task_key(t["strategy"], "newest_first", t["memory"], t["seed"])
        for t in keyed.values()
    }
    assert len(keyed) == len(old["tasks"])
    monkeypatch.setattr(jsonout, "source_commit", lambda: "abc1234")
    path = tmp_path / "study.json"
    path.write_text(
        json.dumps(
            {"requests": 2000, "seeds": 10, "design": {"workload": "azure_conversation_2023"}, "tasks": {}}
        )
    )
    args = cli.build_parser().parse_args(["bench", "reservation", "--json", str(path), "--topic-s", "0"])
    with pytest.raises(ValueError, match="holds a study of"):
        bench_reservation.main(args)


def test_the_tables_and_the_figure_read_the_same_numbers_as_the_summary():
    result = synthetic_result(
        {"worst_case": steady(0.7), "optimistic": steady(0.8), "calibrated": steady(0.98)}
    )
    for t in result["tasks"].values():
        t["loads"] = {str(load): {"attainment": 1.0 - load / 2} for load in bench_reservation.LOADS}
    result["scales"] = {"working_set_blocks": 1000.0}
    result["design"] = {"memory_multiples": list(bench_reservation.MEMORY)}
    text = bench_reservation.markdown_tables(result)
    calibrated = bench_reservation.summarize(result)["1"]["strategies"]["calibrated"]
    ratio = calibrated["over_clairvoyant"]
    assert (
        f"| 1 x (1k blocks) | calibrated | 10 | {calibrated['goodput_per_gpu_mean']:.2f} | {ratio['mean']:.3f} "
        f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] | 0.10% | 0.50% |" in text
    )
    assert "| 0.5 x | clairvoyant | 0.750 | 0.650 | 0.575 | 0.525 |" in text
    over_worst = bench_reservation.summarize(result)["1"]["calibrated_over_worst_case"]
    assert over_worst["mean"] == pytest.approx(0.98 / 0.7, rel=1e-3)
    assert (
        f"| 1 x | 10 | {over_worst['mean']:.3f} [{over_worst['ci95'][0]:.3f}, {over_worst['ci95'][1]:.3f}] "
        "| yes | passes |" in text
    )
    result["summary"] = bench_reservation.summarize(result)
    figure = plot_reservation(result, bench_reservation.GATE, bench_reservation.PASS_MARK)
    panel = bench_reservation.MEMORY.index(1.0)
    bars = [patch.get_height() for patch in figure.axes[panel].patches]
    rows = result["summary"]["1"]["strategies"]
    assert bars == pytest.approx(
        [
            rows[s]["over_clairvoyant"]["mean"]
            for s in ("worst_case", "optimistic", "calibrated", "clairvoyant")
        ]
    )
    assert bars[0] == pytest.approx(0.7) and bars[2] == pytest.approx(0.98)  # the ratios, not the goodputs


def test_tasks_run_before_the_crossing_are_read_again_from_their_bisection():
    evaluations = [[20.0, 1.0], [200.0, 0.0], [110.0, 1.0], [155.0, 0.5], [132.5, 0.7], [121.25, 0.95]]
    old = {"goodput": {"goodput": 121.25, "evaluations": evaluations}, "goodput_per_gpu": 121.25 / 8}
    (migrated,) = bench_reservation.with_interpolated_goodput({"k": old}).values()
    # the crossing of 0.9 between 121.25 (0.95) and 132.5 (0.7): a fifth of the way
    assert migrated["goodput_per_gpu"] == pytest.approx((121.25 + 0.2 * 11.25) / 8)
    assert migrated["bracket_low_per_gpu"] == 121.25 / 8
    assert bench_reservation.with_interpolated_goodput({"k": migrated}) == {"k": migrated}


def test_a_strategy_not_run_at_a_memory_is_left_out_of_its_pairing_and_its_sentences():
    result = synthetic_result(
        {"worst_case": steady(0.7), "optimistic": steady(0.8), "calibrated": steady(0.94)}
    )
    tight = bench_reservation.MEMORY[0]
    for key in [
        k for k, t in result["tasks"].items() if t["strategy"] == "optimistic" and t["memory"] == tight
    ]:
        del result["tasks"][key]
    del result["tasks"][bench_reservation.task_key("calibrated", "newest_first", tight, 9)]
    result["scales"] = {"working_set_blocks": 1000.0}
    row = bench_reservation.summarize(result)[f"{tight:g}"]
    assert row["seeds"] == list(range(9))  # the three run there, paired; optimistic not waited for
    assert row["strategies"]["optimistic"]["n"] == 0 and row["strategies"]["worst_case"]["n"] == 9
    headline = bench_reservation.headline(result, tight)
    assert "n = 9 seeds" in headline and "optimistic" not in headline and "worst case 9.79," in headline
    verdict = bench_reservation.verdict(result, tight)
    assert "the stated gate (at most 0.80) holds" in verdict
    assert "calibrated's interval does not clear 0.95" in verdict and verdict.endswith(
        "the stated test fails"
    )


def test_the_victims_table_is_the_paired_ratio_to_newest_first():
    result = synthetic_result(
        {"worst_case": steady(0.7), "optimistic": steady(0.8), "calibrated": steady(0.98)}
    )
    for key, t in victims_result({"pressure_aware": steady(1.15)})["tasks"].items():
        if t["victim"] == "pressure_aware":
            result["tasks"][key] = {**t, "fault_step_fraction": 0.0, "thrown_away_fraction": 0.0}
    result["design"] = {
        "strategies": list(bench_reservation.STRATEGIES),
        "victims": ["newest_first", "pressure_aware"],
    }
    for t in result["tasks"].values():
        t["loads"] = {str(load): {"attainment": 1.0} for load in bench_reservation.LOADS}
    result["scales"] = {"working_set_blocks": 1000.0}
    text = bench_reservation.markdown_tables(result)
    ratio = bench_reservation.summarize_victims(result)["1|calibrated"]["over_newest_first"]["pressure_aware"]
    # newest_first's calibrated goodput is 0.98 x the bound's, pressure_aware's 1.15 x (10 + seed)
    assert ratio["mean"] == pytest.approx(1.15 / 0.98, rel=1e-3)
    assert (
        f"| 1 x, calibrated | pressure_aware | 10 | {ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, "
        f"{ratio['ci95'][1]:.3f}] |" in text
    )


@pytest.mark.parametrize(
    "gains,topic_s,ends",
    [
        (
            {"pressure_aware": steady(0.95), "expert_lru": steady(1.01)},
            1.5,
            "short of the stated gain of 10%: (V) fails",
        ),
        (
            {"pressure_aware": steady(0.95), "expert_lru": steady(1.01)},
            0.0,
            "short of the stated gain of 10%",
        ),
        ({"pressure_aware": steady(1.15), "expert_lru": steady(1.01)}, 1.5, "the stated gain of 10% holds"),
    ],
    ids=["fails", "other-skew", "holds"],
)
def test_the_victims_sentence_names_the_best_device_aware_victim_and_its_verdict(gains, topic_s, ends):
    result = {**victims_result(gains), "topic_s": topic_s}
    sentence = bench_reservation.victims_verdict(result, 0.125)
    best = max(gains, key=lambda victim: gains[victim](0))
    ratio = bench_reservation.summarize_victims(result)["0.125|calibrated"]["over_newest_first"][best]
    assert sentence.startswith(f"at topic_s {topic_s:g}, the best device-aware victim, {best}, reaches")
    assert f"{ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]" in sentence
    assert sentence.endswith(ends)
    assert "no verdict" in bench_reservation.victims_verdict({**result, "tasks": {}}, 0.125)


def test_the_robustness_table_ranks_by_the_paired_interval():
    """Calibrated 1.2x worst case on every seed ranks first; 0.9x ranks worst case first; a ratio
    whose sign flips with the seed is not told apart. Only memories where both ran appear."""
    rows = {}
    for scale, gain in (
        (1, steady(1.2)),
        (3, steady(0.9)),
        (10, lambda seed: 1.0 + (0.2 if seed % 2 else -0.2)),
    ):
        result = synthetic_result(
            {
                "worst_case": steady(0.7),
                "optimistic": steady(0.8),
                "calibrated": lambda seed, g=gain: 0.7 * g(seed),
            }
        )
        for key in [k for k, t in result["tasks"].items() if t["memory"] != 0.125]:
            del result["tasks"][key]
        rows[scale] = result
    table = bench_reservation.robustness_table(rows).splitlines()
    assert len(table) == 2 + 3
    assert table[2].startswith("| x1 | 0.125 x | 10 |") and table[2].endswith("| calibrated first |")
    assert table[3].startswith("| x3 |") and table[3].endswith("| worst case first |")
    assert table[4].startswith("| x10 |") and table[4].endswith("| not told apart |")
