"""moekv_ref.profiling: phases cost nothing and record nothing outside collect(); inside, the model's
phases add up to no more than its forward, and bench step's profile splits a step."""

import pytest
import torch
from helpers import random_model, small_config

from moekv_ref import profiling
from moekv_ref.apps import bench_step
from moekv_ref.apps.bench_peer import random_dense_model
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams


def test_phase_is_a_shared_no_op_outside_collect():
    assert profiling.phase("attend") is profiling.phase("routing")
    with profiling.phase("attend"):
        pass
    assert profiling._totals is None


def test_collect_sees_every_model_phase_inside_the_forward():
    model = random_model(small_config(), seed=0, dtype=torch.float32)
    with profiling.collect() as times:
        generate(model, [[1, 2, 3], [4]], SamplingParams(max_new_tokens=3, temperature=0.0), cache="paged")
    for name in bench_step.MODEL_PHASES + ("forward", "sampling"):
        assert times[name] > 0, name
    assert sum(times[name] for name in bench_step.MODEL_PHASES) <= times["forward"]
    with pytest.raises(RuntimeError, match="already"):
        with profiling.collect():
            with profiling.collect():
                pass


def test_profile_steps_splits_a_step_into_its_phases():
    result = bench_step.profile_steps(random_dense_model(seed=0), num_seqs=2, max_new_tokens=3, num_rounds=1)
    assert result["num_decode_steps"] == 2
    phases = result["phases_ms"]
    assert set(phases) == set(bench_step.PHASE_NAMES)
    assert sum(phases.values()) == pytest.approx(result["step_ms"])
    assert "attend" in bench_step.format_profile(
        {"num_seqs": 2, "max_new_tokens": 3, "dense": result, "embedded": result}
    )
