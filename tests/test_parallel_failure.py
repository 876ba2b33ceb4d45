"""A rank that dies or hangs: every rank exits soon, with an error naming the rank and the collective.

Rank 1 of 2 fails at the start of decode step 2, while rank 0 goes on into the step's first
collective. Dead: its connections close, rank 0's collective raises at once. Hung: rank 0's
collective times out after the launcher's timeout (5 s here, 20 s by default), and the launcher kills
the hung rank. Either way the launch must end well within 30 s of the failure, and the error must
say which rank never reached which collective.
"""

import re

import pytest

from moekv_ref.parallel import WorkerFailed, launch
from moekv_ref.parallel.programs import ModelSpec, RunSpec, run_specs

from helpers import small_config

CONFIG = small_config(num_attention_experts=4, num_attention_experts_per_tok=2, num_local_experts=2)


def spec(mode: str) -> RunSpec:
    ranks = ((0, 0, 1, 1),) * CONFIG.num_hidden_layers
    return RunSpec(ModelSpec(CONFIG.to_dict(), seed=0), "kv_with_expert", ranks, ((0, 1),) * CONFIG.num_hidden_layers,
                   prompts=((1, 2, 3), (4, 5)), decode_tokens=((6,) * 4, (7,) * 4), num_blocks=64, block_size=4,
                   fail_rank=1, fail_step=2, fail_mode=mode)


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_failed_rank_is_named_and_everyone_exits(mode):
    with pytest.raises(WorkerFailed) as failure:
        launch(run_specs, 2, ([spec(mode)],), timeout_s=5.0, grace_s=2.0)
    elapsed = failure.value.ended_at - failure.value.fault_at   # from the fault to the last rank gone
    message = str(failure.value)
    # rank 0 names rank 1 as the one that never reached its collective, at step 2
    assert re.search(r"rank 0: CollectiveError: rank 0: all_to_all_single #\d+ \(\w+, step 2\) failed: "
                     r"rank 1 \(last reached all_to_all_single #\d+ \(\w+, step 1\)\) never reached it", message), message
    if mode == "die":
        assert "rank 1: exited with code 3" in message
    else:
        assert "rank 1: killed by the launcher" in message
    print(f"{mode}: every rank gone {elapsed:.1f} s after the fault")
    assert 0 < elapsed < 30, f"took {elapsed:.1f} s"
