"""A rank that dies, hangs or starts late: every rank exits soon, with an error naming the rank that
kept the others waiting, and a slow start is not mistaken for a hang.

Rank 1 of 2 fails at the start of decode step 2, while rank 0 goes on into the step's first
collective. Dead: its connections close, rank 0's collective raises at once. Hung: rank 0's
collective times out after the collective timeout (3 s here to keep the tests short, 15 s by
default), and the launcher (or torchrun) ends the hung rank. Among 4 ranks, the healthy ones name
the dead rank only, even when one of them is still on its way to the collective. The start-up has
its own, generous timeout (120 s by default), so a rank that joins late is waited for.

One test runs torchrun with the default timeouts, as a user would (about 20 s): every rank must be
gone within 30 s of a rank's stop (SIGSTOP), and torchrun's summary must name the stopped rank.
"""

import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import small_config

from moekv_ref.apps import parallel_run as parallel_main
from moekv_ref.parallel import CollectiveError, WorkerFailed, launch, launcher
from moekv_ref.parallel.programs import ModelSpec, RunSpec, inject_failure, run_parallel, run_specs

CONFIG = small_config(num_attention_experts=4, num_attention_experts_per_tok=2, num_local_experts=2)
REPOSITORY = Path(__file__).resolve().parents[2]


def spec(mode: str = "") -> RunSpec:
    ranks = ((0, 0, 1, 1),) * CONFIG.num_hidden_layers
    return RunSpec(
        ModelSpec(CONFIG.to_dict(), seed=0),
        "kv_with_expert",
        ranks,
        ((0, 1),) * CONFIG.num_hidden_layers,
        prompts=((1, 2, 3), (4, 5)),
        decode_tokens=((6,) * 4, (7,) * 4),
        num_blocks=64,
        block_size=4,
        fail_rank=1 if mode else -1,
        fail_step=2 if mode else -1,
        fail_mode=mode,
    )


@pytest.mark.parametrize("mode", ["die", "hang", "stop"])
def test_failed_rank_is_named_and_everyone_exits(mode):
    with pytest.raises(WorkerFailed) as failure:
        launch(run_specs, 2, ([spec(mode)],), timeout_s=3.0, grace_s=2.0)
    elapsed = failure.value.ended_at - failure.value.fault_at  # from the fault to the last rank gone
    message = str(failure.value)
    # the message starts with the rank that kept its peer waiting; rank 0 names it, with the collective
    assert failure.value.missing == (1,), message
    assert message.startswith("rank 1 kept its peers waiting in vain"), message
    assert re.search(
        r"rank 0: CollectiveError: rank 1 never reached all_to_all_single #\d+ \(\w+, step 2\): "
        r"hung or dead \(rank 1 last reached all_to_all_single #\d+ \(\w+, step 1\)\); "
        r"rank 0 waited [\d.]+ s in it",
        message,
    ), message
    if mode == "die":
        assert "rank 1: exited with code 3" in message
    else:
        assert "rank 1: killed by the launcher" in message
        waited = float(re.search(r"rank 0 waited ([\d.]+) s", message).group(1))
        assert 2.9 <= waited < 10, message  # the collective timeout
    print(f"{mode}: every rank gone {elapsed:.1f} s after the fault")
    assert 0 < elapsed < (5 if mode == "die" else 10), f"took {elapsed:.1f} s"


def dawdle_or_die(context, dead: int, slow: int, delay_s: float) -> None:
    """Worker: three steps of one all-to-all each; at step 2 rank `dead` dies before it, and rank
    `slow` reaches it delay_s late, healthy but behind the others when the dead rank's connections
    close."""
    comm = context.comm
    for step in range(3):
        comm.start_step(step)
        if (step, context.rank) == (2, dead):
            inject_failure("die", comm.store)
        if (step, context.rank) == (2, slow):
            time.sleep(delay_s)
        comm.all_to_all(torch.zeros(context.world_size, 1), [1] * context.world_size, "test")


def test_a_dead_rank_among_four_is_the_only_one_named():
    """Ranks 0 and 2 fail the moment rank 3 dies, while rank 1 is still on its way to the same
    collective: none of them may blame rank 1, which is slow, not hung."""
    with pytest.raises(WorkerFailed) as failure:
        launch(dawdle_or_die, 4, (3, 1, 0.5), timeout_s=3.0, grace_s=2.0)
    message = str(failure.value)
    assert failure.value.missing == (3,), message
    for rank in (0, 1, 2):
        assert re.search(
            rf"^rank {rank}: CollectiveError: rank 3 never reached all_to_all_single #\d+ \(\w+, step 2\)",
            message,
            re.MULTILINE,
        ), message
    assert "rank 3: exited with code 3" in message
    print(f"every rank gone {failure.value.ended_at - failure.value.fault_at:.1f} s after the fault")


def test_a_slow_start_is_waited_for(monkeypatch):
    """Rank 1 joins 3 s late while a collective may wait only 1.5 s: the start-up timeout, not the
    collective one, governs joining."""
    monkeypatch.setenv(launcher.FAULT_ENV, "slow_start@1:3")
    start = time.monotonic()
    results = run_parallel([spec()], 2, timeout_s=1.5)[0]
    assert [r.rank for r in results] == [0, 1] and time.monotonic() - start > 3


@pytest.mark.parametrize("started_by", ["launch", "torchrun"])
def test_a_rank_that_never_joins_is_named(monkeypatch, started_by):
    """Here, in this process, as rank 0 of 2: rank 1 never comes, and the start-up timeout says who.
    Under launch a rank is handed the parent's store; under torchrun it finds its agent's store
    through the environment torchrun sets, which this test sets instead (torchrun adds only the
    processes, and the agent that hosts the store)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )
    joining = {"store": store, "rank": 0, "world_size": 2}
    if started_by == "torchrun":
        environment = {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        joining = {}
    with pytest.raises(
        CollectiveError,
        match=r"^rank 1 never joined the process group: rank 0 waited [\d.]+ s "
        r"for it \(start timeout 1 s\)",
    ) as error:
        launcher.join_group("gloo", 1.5, 1.0, **joining)
    assert error.value.missing == (1,) and not dist.is_initialized()


def test_default_timeouts_clear_a_hung_rank_within_30_s():
    """The defaults, everywhere they are set: a collective gives up after 15 s, the rank waits 2 s
    more for its peers to catch up or fail (SETTLE_S), and the launcher kills what is left 3 s later
    (20 s); joining may take 120 s. torchrun's monitor notices a failed rank within its interval
    (0.1 s)."""
    import inspect

    from torch.distributed import run as torchrun

    from moekv_ref.parallel.comm import SETTLE_S

    timeout, grace = launcher.DEFAULT_TIMEOUT_S, launcher.DEFAULT_GRACE_S
    assert timeout + SETTLE_S + grace + 5 <= 30 and launcher.DEFAULT_START_TIMEOUT_S >= 60
    for function in (launch, run_parallel):
        defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()}
        assert (
            defaults["timeout_s"] == timeout
            and defaults["start_timeout_s"] == launcher.DEFAULT_START_TIMEOUT_S
        )
    assert inspect.signature(launch).parameters["grace_s"].default == grace
    args = parallel_main.build_parser().parse_args([])
    assert (args.timeout, args.start_timeout) == (timeout, launcher.DEFAULT_START_TIMEOUT_S)
    assert torchrun.get_args_parser().parse_args(["x"]).monitor_interval <= 1


def test_torchrun_with_defaults_names_a_stopped_rank_and_ends_it_within_30_s():
    """Rank 0 is stopped (SIGSTOP), which torchrun's SIGTERM cannot end: torchrun would wait 30 s
    before its SIGKILL. Rank 1 times out, names rank 0 and kills it (both run on this machine) after
    writing its message, which must be torchrun's root cause although rank 0 is the lower rank."""
    env = dict(
        os.environ,
        MOEKV_FAULT="stop@0:2",
        PYTHONPATH=os.pathsep.join(
            [str(REPOSITORY)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    env.pop("RANK", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "-m",
            "moekv_ref.apps.parallel_run",
            "--context",
            "16",
            "--decode-steps",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=REPOSITORY,
    )
    ended = time.time()
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    fault_at = float(re.search(r"injected fault: stop at wall-clock time ([\d.]+)", output).group(1))
    print(f"torchrun, defaults: every rank gone {ended - fault_at:.1f} s after the stop")
    assert ended - fault_at < 30, output
    # the failed rank says so itself, and torchrun's summary (its root cause) carries that message
    named = r"rank 0 never reached all_to_all_single #\d+ \(\w+, step 2\): hung or dead"
    assert re.search(r"\[rank1\] error: CollectiveError: " + named, output), output
    assert re.search(r"\[rank1\] killed rank 0 \(pid \d+\)", output), output
    root_cause = output.split("Root Cause")[-1]
    assert re.search(named + r".*rank 1 waited 1[5-9]\.\d s", root_cause), output  # the default 15 s
