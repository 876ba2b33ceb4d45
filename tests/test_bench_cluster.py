"""bench cluster's summary (apps/bench_cluster.py): which victim leads at a setting is read from SLO
attainment at that rate, where a refused request counts as missing its SLOs."""

import pytest

from moekv_ref.apps.bench_cluster import BETTER_BY, where_policies_differ


def run(policy: str, attainment: float, rate: float = 150.0) -> dict:
    return {
        "devices": 8,
        "gib_per_device": 0.5,
        "rate": rate,
        "arrivals": "poisson",
        "reservation": "optimistic",
        "policy": policy,
        "slo_attainment": attainment,
    }


def test_the_leader_is_the_highest_attainment_and_matters_past_five_points():
    rows = where_policies_differ(
        [
            run("sequence_lru", 0.70),
            run("pressure_aware", 0.76),
            run("expert_lru", 0.20),
            run("sequence_lru", 0.50, rate=300.0),
            run("pressure_aware", 0.53, rate=300.0),
        ]
    )
    first, second = rows
    assert first["best_policy"] == "pressure_aware" and first["gain"] == pytest.approx(0.06)
    assert first["policy_matters"] and 0.06 > BETTER_BY
    assert second["best_policy"] == "pressure_aware" and not second["policy_matters"]  # 3 points


def test_without_sequence_lru_nothing_is_said_to_matter():
    (row,) = where_policies_differ([run("pressure_aware", 0.9), run("expert_lru", 0.1)])
    assert row["best_policy"] == "pressure_aware" and not row["policy_matters"]
