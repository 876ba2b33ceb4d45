"""`python -m moekv_ref bench cluster [--json PATH]`: where the victim policies differ on a cluster.

An expert-attention model of JetMoE-8B's size (preset jetmoe-8b-expert-kv: 24 layers, 8 attention
experts, top-2, each keeping its own 16 K/V heads of 128 in bfloat16: 8 KiB per (token, layer,
expert) entry, 2.2 B active parameters; the real JetMoE shares K/V between its experts) served by
expert parallelism on D H200s, each holding E / D experts of every layer and their rows' blocks.
Requests have the lengths of a published trace (sim/workloads.py), cut to the model's 4,096
positions, and arrive as a Poisson or bursty process at a given rate; routing is a topic trace
(sequences lean on their topic's experts, so one device's pool fills first). The engine's own
Scheduler runs over it (sim/runner.py), each step costing the projected cluster time
(costs.cluster_cost_model: compute split evenly over the GPUs, links left out).

For every (device count, KV memory per GPU, arrival rate, victim policy): TTFT and TPOT at p50 and
p99 and SLO attainment under DistServe's chatbot SLOs (TTFT 0.25 s, TPOT 0.1 s), preemptions and
recomputed tokens. The summary marks where the best policy's attainment is more than 5 points
above sequence_lru's at the same rate (a refused request counts as missing its SLOs, so refusing
work never ranks higher), and goodput as DistServe defines it: the highest swept rate whose
attainment reaches 90%. These are short runs (150 requests, nothing left out); the comparison in
steady state, with intervals over seeds, is `bench reservation`'s.

JetMoE has 8 attention experts, so one expert-parallel group has at most 8 GPUs. `--devices` takes
1, 2, 4 or 8 (one group), or a multiple of 8: G = D / 8 groups of 8 GPUs behind a dispatcher that
hands arriving requests out in turn (`round_robin`). The groups share nothing, so each is simulated on
its own requests, one after another, and the latencies are summarized over all of them. `--requests`
and `--rates` are per group: D GPUs serve G times the requests, arriving G times as fast.

`--sessions [--requests N] [--think-seconds S]` serves multi-turn sessions instead (turns and
lengths around LMSYS-Chat-1M's means, sim/workloads.py; each turn's prompt the whole conversation
so far, sim/traces.py), with the engine's prefix cache off and on: what a turn finds of the turn
before it, at each memory and rate, in hit tokens, TTFT and goodput.

The simulator's own speed is `bench simulator`'s (apps/bench_simulator.py).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from tqdm import tqdm

from ..config import get_config
from ..costs import cluster_cost_model
from ..engine.scheduler_config import RESERVATIONS
from ..engine.victims import VICTIM_POLICIES
from ..jsonout import write
from ..sim.cluster import BLOCK_SIZE, MODEL, cluster_placement, pool_blocks
from ..sim.runner import RunnerSetup, TraceRunner
from ..sim.traces import conversation_lengths, conversation_turns, topic_trace
from ..sim.workloads import (
    ARRIVALS,
    arrival_times,
    decode_heavy_lengths,
    latency_summary,
    length_workloads,
    round_robin,
    sample_lengths,
    sample_sessions,
    session_arrivals,
    session_workloads,
)
from ..validation import MAX_TRACE_REQUESTS, is_integer
from . import options

ACTIVE_PARAMS = 2.2e9  # JetMoE-8B's active parameters (Shen et al., arXiv 2404.07413)
# DistServe's chatbot SLOs (Zhong et al., OSDI 2024, Table 1)
TTFT_SLO = 0.25
TPOT_SLO = 0.1
ATTAINMENT_TARGET = 0.9  # DistServe's goodput: the highest rate at 90% attainment
POLICIES = ("sequence_lru", "pressure_aware", "expert_lru")
BETTER_BY = 0.05  # "the policy matters": attainment more than 5 points above sequence_lru's
GAMMA_CV = 2.0  # bursty arrivals: gaps' coefficient of variation (Poisson: 1)
REQUESTS = 150  # the default of a sweep
RATES = (150.0, 300.0)  # requests per second (and group) of a sweep
SESSION_WORKLOAD = "lmsys_chat_1m"
GIB_PER_DEVICE = (0.5, 1.0)  # KV memory per GPU of a sweep: small, so that memory binds
SESSION_RATES = (200.0, 800.0)  # sessions per second of --sessions
SESSION_GIB_PER_DEVICE = (0.125, 0.5)  # its memories: where cached blocks outlive a think time, and not
H200_GIB = 141e9 / 2**30  # an H200's memory (141 GB), the most KV memory one of its GPUs could have
MAX_DEVICES = 1024  # the most GPUs a sweep takes (groups of 8 are simulated one after another)
THINK_SECONDS = 5.0  # the mean pause between a turn's end and the next turn (not published: a setting)
WORKLOAD = "azure_conversation_2023"  # the sweep's published lengths
QUICK_REQUESTS = 40  # --quick's requests (or sessions)
TOPIC_S = 1.5  # the topic trace's skew (sim/traces.py's default)
DECODE_HEAVY = "decode_heavy"  # a workload of short prompts and long outputs (cluster_workload)
# The options left out, as each program reads them (the parser's defaults are None, so that an option
# given to a program that does not read it can be told apart from one left out, and refused)
DEFAULTS = {
    "workload": WORKLOAD,
    "devices": [8],
    "arrivals": ["poisson"],
    "reservations": list(RESERVATIONS),
    "policies": list(POLICIES),
    "max_num_seqs": 256,
    "seed": 0,
    "think_seconds": THINK_SECONDS,
}
# The programs each option is read by: the sweep (no --sessions) and --sessions (one group, Poisson
# arrivals, sequence_lru, worst-case reservation: its own grid); --requests and --json are read by both.
READ_BY = {
    "--workload": ("sweep",),
    "--devices": ("sweep", "--sessions"),
    "--gib-per-device": ("sweep", "--sessions"),
    "--rates": ("sweep", "--sessions"),
    "--arrivals": ("sweep",),
    "--reservations": ("sweep",),
    "--policies": ("sweep",),
    "--max-num-seqs": ("sweep", "--sessions"),
    "--seed": ("sweep", "--sessions"),
    "--quick": ("sweep", "--sessions"),
    "--think-seconds": ("--sessions",),
}


def model_trace(lengths: tuple, seed: int, name: str, topic_s: float = TOPIC_S):
    """A topic routing trace of MODEL's shape over sequences of the given (prompts, outputs), its
    topics' popularity Zipf with exponent topic_s (0: every topic alike)."""
    config = get_config(MODEL)
    trace, _ = topic_trace(
        lengths[0].numel(),
        config.num_hidden_layers,
        config.num_attention_experts,
        config.num_attention_experts_per_tok,
        topic_s=topic_s,
        kv_bytes_per_slot=config.kv_bytes_per_entry(),
        seed=seed,
        name=name,
        lengths=lengths,
    )
    return trace


def cluster_workload(num_requests: int, workload: str, seed: int, topic_s: float = TOPIC_S):
    """The routing trace (MODEL's shape, lengths of `workload` cut to 4,096 tokens; DECODE_HEAVY:
    sim/workloads.py's decode_heavy_lengths, short prompts and long outputs)."""
    max_tokens = get_config(MODEL).max_position_embeddings
    if workload == DECODE_HEAVY:
        lengths = decode_heavy_lengths(num_requests, seed, max_tokens=max_tokens)
    else:
        lengths = sample_lengths(workload, num_requests, seed, max_tokens=max_tokens)
    return model_trace(lengths, seed, workload, topic_s)


def session_workload(num_sessions: int, seed: int) -> tuple:
    """The turns of multi-turn sessions (SESSION_WORKLOAD's means, each conversation cut to MODEL's
    4,096 positions) over a topic routing trace of MODEL's shape: (trace of the turns, follows)."""
    max_tokens = get_config(MODEL).max_position_embeddings
    session, prompts, outputs = sample_sessions(SESSION_WORKLOAD, num_sessions, seed, max_tokens=max_tokens)
    lengths = conversation_lengths(session, prompts, outputs)  # (sessions,) each conversation's tokens
    whole = ((lengths - 1).clamp(min=1), torch.ones_like(lengths))  # one sequence a conversation
    conversations = model_trace(whole, seed, SESSION_WORKLOAD)
    return conversation_turns(conversations, session, prompts, outputs)


def num_groups(num_devices: int) -> int:
    """Expert-parallel groups of num_devices GPUs: one of up to E GPUs, or D / E of E GPUs each."""
    experts = get_config(MODEL).num_attention_experts
    return num_devices // experts if num_devices > experts else 1


def run_one(
    trace,
    num_devices: int,
    gib_per_device: float,
    rate: float,
    arrivals: str,
    policy: str,
    reservation: str,
    max_num_seqs: int,
    seed: int,
    follows: torch.Tensor | None = None,
    think_seconds: float = THINK_SECONDS,
    prefix_caching: bool = False,
) -> dict:
    """One run of the sweep: requests arriving at `rate` per second and group, or, with follows (the
    turns of sessions, one group), sessions at `rate` per second whose later turns come think_seconds
    (mean) after the turn before them finished. On several groups (num_groups) each serves the
    requests `round_robin` hands it, and the numbers are over all of them."""
    config = get_config(MODEL)
    groups = num_groups(num_devices)
    group_devices = num_devices // groups
    placement = cluster_placement(group_devices)
    blocks = pool_blocks(gib_per_device)
    setup = RunnerSetup(
        blocks_per_device=blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        admission="predicted",
        reservation=reservation,
        prefix_caching=prefix_caching,
    )
    cost = cluster_cost_model(config, ACTIVE_PARAMS, group_devices, BLOCK_SIZE)
    if follows is None:
        arrival = arrival_times(trace.num_sequences, rate * groups, arrivals, cv=GAMMA_CV, seed=seed)
    elif groups > 1:
        raise ValueError(f"sessions are served by one group, not {groups} (num_devices={num_devices})")
    else:
        arrival = session_arrivals(follows, rate, think_seconds, arrivals, GAMMA_CV, seed)
    started = time.perf_counter()
    runs = []  # each group's RunnerStats
    for seqs in round_robin(arrival, groups):
        served = trace if groups == 1 else trace.subset(seqs.tolist())
        runner = TraceRunner(served, placement, setup, policy, cost, arrivals=arrival[seqs], follows=follows)
        runs.append(runner.run(max_steps=10_000_000))
    wall = time.perf_counter() - started
    latency = latency_summary(
        *(
            torch.cat([getattr(stats, name) for stats in runs])
            for name in ("arrival_seconds", "first_token_seconds", "finish_seconds", "num_output_tokens")
        ),
        TTFT_SLO,
        TPOT_SLO,
    )
    seconds = max(stats.seconds for stats in runs)  # the groups run side by side
    steps = sum(stats.num_steps for stats in runs)
    used = [float(stats.used_blocks.double().mean() / blocks) for stats in runs if stats.num_steps]
    return {
        "devices": num_devices,
        "groups": groups,
        "gib_per_device": gib_per_device,
        "blocks_per_device": blocks,
        "rate": rate,
        "arrivals": arrivals,
        "policy": policy,
        "reservation": reservation,
        **latency,
        "steps": steps,
        "modelled_seconds": seconds,
        "refused": sum(stats.num_refused for stats in runs),
        "evictions": sum(stats.num_evictions for stats in runs),
        "victim_sequences": sum(stats.num_victim_sequences for stats in runs),
        "recomputed_tokens": sum(stats.recomputed_tokens for stats in runs),
        "tokens_per_second": sum(stats.finished_tokens for stats in runs) / seconds if seconds > 0 else 0.0,
        "retries": sum(stats.num_retries for stats in runs),
        "thrown_away_tokens": sum(stats.thrown_away_tokens for stats in runs),
        "thrown_away_seconds": sum(stats.thrown_away_seconds for stats in runs),
        "mean_used_fraction": sum(used) / len(used) if used else 0.0,  # the groups' mean
        "prefix_caching": prefix_caching,
        "prompt_tokens": int(trace.prompt_lens.sum()),
        "prefix_hit_tokens": sum(stats.prefix_hit_tokens for stats in runs),
        "wall_seconds": wall,
        "steps_per_wall_second": steps / max(wall, 1e-9),
    }


def where_policies_differ(runs: list[dict]) -> list[dict]:
    """Per setting (devices, memory, rate, arrivals): the best policy's SLO attainment against
    sequence_lru's, and whether it is more than BETTER_BY ahead (in points of attainment)."""
    settings = {}
    for run in runs:
        key = (run["devices"], run["gib_per_device"], run["rate"], run["arrivals"], run["reservation"])
        settings.setdefault(key, {})[run["policy"]] = run
    rows = []
    for (devices, gib, rate, arrivals, reservation), by_policy in settings.items():
        baseline = by_policy.get("sequence_lru")
        best = max(by_policy.values(), key=lambda r: r["slo_attainment"])
        base = baseline["slo_attainment"] if baseline else float("nan")
        gain = best["slo_attainment"] - base
        rows.append(
            {
                "devices": devices,
                "gib_per_device": gib,
                "rate": rate,
                "arrivals": arrivals,
                "reservation": reservation,
                "best_policy": best["policy"],
                "best_attainment": best["slo_attainment"],
                "sequence_lru_attainment": base,
                "gain": gain,
                "policy_matters": bool(gain > BETTER_BY) if not math.isnan(gain) else False,
            }
        )
    return rows


def goodput(runs: list[dict]) -> list[dict]:
    """Per (devices, memory, arrivals, policy): the highest swept rate with attainment >= 90%."""
    groups = {}
    for run in runs:
        groups.setdefault(
            (run["devices"], run["gib_per_device"], run["arrivals"], run["reservation"], run["policy"]), []
        ).append(run)
    rows = []
    for (devices, gib, arrivals, reservation, policy), group in groups.items():
        met = [r["rate"] for r in group if r["slo_attainment"] >= ATTAINMENT_TARGET]
        rows.append(
            {
                "devices": devices,
                "gib_per_device": gib,
                "arrivals": arrivals,
                "reservation": reservation,
                "policy": policy,
                "goodput_requests_per_s": max(met) if met else 0.0,
                "rates_swept": sorted(r["rate"] for r in group),
            }
        )
    return rows


def print_tables(result: dict) -> None:
    print(
        f"\n{result['workload']} lengths, {result['requests']} requests; {MODEL} on H200s (projected); "
        f"SLOs TTFT {TTFT_SLO} s, TPOT {TPOT_SLO} s"
    )
    experts = get_config(MODEL).num_attention_experts  # the GPUs of one group, at most
    if any(r["devices"] > experts for r in result["runs"]):
        print(
            f"D > {experts} GPUs: D / {experts} groups of {experts}, requests handed out in turn; "
            "requests and rates are a group's"
        )
    print(
        f"{'D':>2} {'GiB':>5} {'rate':>6} {'arrivals':>8} {'reservation':>11} {'policy':>15} {'TTFT p50':>9} "
        f"{'p99':>7} {'TPOT p50':>9} {'p99':>7} {'attain':>6} {'used':>5} {'victims':>7} "
        f"{'recomputed':>10} {'retries':>7} {'thrown':>7}"
    )
    for r in result["runs"]:
        print(
            f"{r['devices']:>2} {r['gib_per_device']:>5} {r['rate']:>6} {r['arrivals']:>8} {r['reservation']:>11} "
            f"{r['policy']:>15} {r['ttft_p50_s']:>9.3f} {r['ttft_p99_s']:>7.3f} {r['tpot_p50_s'] * 1e3:>7.2f}ms "
            f"{r['tpot_p99_s'] * 1e3:>5.1f}ms {r['slo_attainment']:>6.3f} "
            f"{r['mean_used_fraction']:>5.2f} {r['victim_sequences']:>7} {r['recomputed_tokens']:>10} "
            f"{r['retries']:>7} {r['thrown_away_tokens']:>7}"
        )
    print("\nwhere the best policy's SLO attainment is more than 5 points above sequence_lru's:")
    for r in where_policies_differ(result["runs"]):  # read from the runs: files from before kept another rule
        mark = "  <- matters" if r["policy_matters"] else ""
        print(
            f"  D={r['devices']} {r['gib_per_device']} GiB rate {r['rate']} {r['arrivals']} {r['reservation']}: "
            f"best {r['best_policy']} "
            f"{r['best_attainment']:.3f} vs sequence_lru {r['sequence_lru_attainment']:.3f} "
            f"({r['gain']:+.3f}){mark}"
        )
    print("\ngoodput (the highest swept rate with >= 90% of requests within both SLOs):")
    for r in result["goodput"]:
        print(
            f"  D={r['devices']} {r['gib_per_device']} GiB {r['arrivals']} {r['reservation']} {r['policy']}: "
            f"{r['goodput_requests_per_s']} requests/s"
        )


# ----- multi-turn sessions, prefix caching off and on --------------------------------------------------
def measure_sessions(
    num_sessions: int,
    devices: int,
    gib_per_device: list[float],
    rates: list[float],
    think_seconds: float,
    max_num_seqs: int,
    seed: int,
) -> dict:
    """Every (memory, session rate) with the prefix cache off and on (sequence_lru, worst-case
    reservation, Poisson session arrivals), and per pair what caching changed."""
    trace, follows = session_workload(num_sessions, seed)
    grid = [(gib, rate, cached) for gib in gib_per_device for rate in rates for cached in (False, True)]
    runs = []
    for gib, rate, cached in tqdm(grid, desc="sessions", unit="run", disable=None):
        runs.append(
            run_one(
                trace,
                devices,
                gib,
                rate,
                "poisson",
                "sequence_lru",
                "worst_case",
                max_num_seqs,
                seed,
                follows=follows,
                think_seconds=think_seconds,
                prefix_caching=cached,
            )
        )
    first = follows < 0
    # a later turn's prompt begins with the tokens the turn before it stored: the most a hit can skip
    shareable = int(trace.lengths[follows[~first]].sum())
    pairs = []
    for off, on in zip(runs[0::2], runs[1::2]):
        pairs.append(
            {
                "gib_per_device": off["gib_per_device"],
                "rate": off["rate"],
                "hit_share": on["prefix_hit_tokens"] / on["prompt_tokens"],
                "hit_share_of_shareable": on["prefix_hit_tokens"] / shareable,
                "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"],
                "ttft_p99_ratio": on["ttft_p99_s"] / off["ttft_p99_s"],
                "slo_attainment_off": off["slo_attainment"],
                "slo_attainment_on": on["slo_attainment"],
            }
        )
    return {
        "model": MODEL,
        "workload": SESSION_WORKLOAD,
        "workload_source": session_workloads()[SESSION_WORKLOAD]["source"],
        "sessions": num_sessions,
        "turns": trace.num_sequences,
        "turns_per_session_mean": trace.num_sequences / num_sessions,
        "first_turn_prompt_tokens_mean": float(trace.prompt_lens[first].double().mean()),
        "later_turn_prompt_tokens_mean": float(trace.prompt_lens[~first].double().mean()),
        "output_tokens_mean": float((trace.lengths - trace.prompt_lens + 1).double().mean()),
        "prompt_tokens": int(trace.prompt_lens.sum()),
        "shareable_prompt_tokens": shareable,
        "think_seconds_mean": think_seconds,
        "devices": devices,
        "policy": "sequence_lru",
        "reservation": "worst_case",
        "ttft_slo_s": TTFT_SLO,
        "tpot_slo_s": TPOT_SLO,
        "seed": seed,
        "max_num_seqs": max_num_seqs,
        "runs": runs,
        "prefix_caching": pairs,
    }


def print_sessions(result: dict) -> None:
    """The sessions table: "found" is the share of the history (what each turn before stored) that
    the later turns started from, as the README's table gives it."""
    print(
        f"\n{result['sessions']} sessions ({result['turns']} turns) around {result['workload']}'s means; "
        f"prompts {result['first_turn_prompt_tokens_mean']:.0f} tokens on a first turn, "
        f"{result['later_turn_prompt_tokens_mean']:.0f} on a later one; think time "
        f"{result['think_seconds_mean']} s (mean); {MODEL} on {result['devices']} H200s (projected)"
    )
    print(
        f"{'GiB':>5} {'rate':>5} {'prefix cache':>12} {'found':>6} {'TTFT p50':>9} {'p99':>9} "
        f"{'attain':>6} {'victims':>7} {'refused':>7}"
    )
    for r in result["runs"]:
        found = r["prefix_hit_tokens"] / result["shareable_prompt_tokens"]
        print(
            f"{r['gib_per_device']:>5} {r['rate']:>5} {'on' if r['prefix_caching'] else 'off':>12} "
            f"{found:>6.1%} {r['ttft_p50_s'] * 1e3:>7.2f}ms {r['ttft_p99_s'] * 1e3:>7.2f}ms "
            f"{r['slo_attainment']:>6.3f} {r['victim_sequences']:>7} "
            f"{r['refused']:>7}"
        )


# ----- the program -------------------------------------------------------------------------------------------
def build_parser(parser=None):
    parser = parser or argparse.ArgumentParser(prog="python -m moekv_ref bench cluster")
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests of the workload (default {REQUESTS}; with --sessions: sessions)",
    )
    parser.add_argument(
        "--workload",
        default=None,
        help=f"published lengths: one of {tuple(length_workloads())} (default {WORKLOAD})",
    )
    parser.add_argument(
        "--devices",
        type=int,
        nargs="+",
        default=None,
        help="GPUs (default 8): 1, 2, 4 or 8 (one expert-parallel group), or a multiple of 8 (groups of 8, requests "
        "handed out in turn; --requests and --rates are per group)",
    )
    parser.add_argument(
        "--gib-per-device",
        type=float,
        nargs="+",
        default=None,
        help=f"KV memory per GPU in GiB (default {GIB_PER_DEVICE}: small, so that memory binds; with "
        f"--sessions {SESSION_GIB_PER_DEVICE})",
    )
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help=f"mean arrival rates, requests per second (default {RATES}; with --sessions, sessions "
        f"per second, default {SESSION_RATES})",
    )
    parser.add_argument(
        "--arrivals", nargs="+", default=None, help=f"arrival processes: {ARRIVALS} (default poisson)"
    )
    parser.add_argument(
        "--reservations",
        nargs="+",
        default=None,
        help=f"the scheduler's reservation strategies (default {RESERVATIONS})",
    )
    parser.add_argument("--policies", nargs="+", default=None, help=f"victim policies (default {POLICIES})")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default 256")
    parser.add_argument("--seed", type=int, default=None, help="default 0")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_REQUESTS} requests, the first memory and rate"
    )
    parser.add_argument(
        "--sessions",
        action="store_true",
        help="serve multi-turn sessions instead, the prefix cache off and on (--requests: sessions)",
    )
    parser.add_argument(
        "--think-seconds",
        type=float,
        default=None,
        help=f"with --sessions: mean seconds between a turn's end and the next turn (default {THINK_SECONDS})",
    )
    return parser


def check_args(args) -> None:
    options.output_file("--json", args.json, parents_made=True)
    check_read(args)
    args = with_defaults(args)
    options.real("--think-seconds", args.think_seconds, 0.0)
    if args.sessions and (len(args.devices) != 1 or num_groups(args.devices[0]) > 1):
        raise ValueError(f"--sessions serves one group: give one --devices of at most 8, not {args.devices}")
    options.count("--max-num-seqs", args.max_num_seqs, 1)
    options.seed("--seed", args.seed)
    if args.workload not in length_workloads():
        raise ValueError(f"--workload {args.workload!r} is not one of {tuple(length_workloads())}")
    experts = get_config(MODEL).num_attention_experts
    for d in args.devices:
        if not is_integer(d) or d < 1 or (experts % d and d % experts) or d > MAX_DEVICES:
            raise ValueError(
                f"--devices {d} must divide {MODEL}'s {experts} attention experts (one group: one of "
                f"{[n for n in range(1, experts + 1) if experts % n == 0]}) or be a multiple of {experts} "
                f"(groups of {experts}), at most {MAX_DEVICES}"
            )
    check_requests(args)
    least = least_blocks_per_device(args.devices)
    for value in args.gib_per_device or ():
        options.real(
            "--gib-per-device",
            value,
            least * block_bytes() / 2**30,
            H200_GIB,
            meaning=f"one token takes {least} blocks of {block_bytes() // 1024} KiB on a GPU of --devices "
            f"{' '.join(map(str, args.devices))}; at most an H200's 141 GB",
        )
    for value in args.rates or ():
        options.real("--rates", value, 0.0, low_open=True)
    for process in args.arrivals:
        if process not in ARRIVALS:
            raise ValueError(f"--arrivals {process!r} is not one of {ARRIVALS}")
    for reservation in args.reservations:
        if reservation not in RESERVATIONS:
            raise ValueError(f"--reservations {reservation!r} is not one of {RESERVATIONS}")
    for policy in args.policies:
        if policy not in VICTIM_POLICIES:
            raise ValueError(f"--policies {policy!r} is not one of {tuple(VICTIM_POLICIES)}")
    if "sequence_lru" not in args.policies:
        raise ValueError("--policies must include sequence_lru, the baseline the others are compared with")
    for name, values in (
        ("--devices", args.devices),
        ("--gib-per-device", args.gib_per_device or ()),
        ("--rates", args.rates or ()),
        ("--arrivals", args.arrivals),
        ("--reservations", args.reservations),
        ("--policies", args.policies),
    ):
        options.distinct(name, values, "each setting of the grid runs once")


def check_read(args) -> None:
    """ValueError for an option given to a program that does not read it (READ_BY), naming both, and
    for --quick beside what it sets."""
    program = "--sessions" if args.sessions else "sweep"
    for option, programs in READ_BY.items():
        value = getattr(args, option[2:].replace("-", "_"))
        given = value is not None and value is not False  # not `in (None, False)`: 0 == False
        if given and program not in programs:
            runs = "the sweep (no --sessions)" if program == "sweep" else program
            readers = " and ".join("the sweep" if p == "sweep" else p for p in programs)
            raise ValueError(
                f"{option} applies to {readers}, not to {runs}: it would be ignored; drop {option}"
            )
    if args.quick and args.requests is not None:
        raise ValueError(
            f"--quick sets its own --requests ({QUICK_REQUESTS}): give either --quick or --requests"
        )
    for option, values in (("--gib-per-device", args.gib_per_device), ("--rates", args.rates)):
        if args.quick and values is not None and len(values) > 1:
            raise ValueError(
                f"--quick runs the first of {option} only: give --quick one {option}, not {len(values)}"
            )


def with_defaults(args) -> argparse.Namespace:
    """args with every option left out (None) set to what the programs read (DEFAULTS)."""
    filled = argparse.Namespace(**vars(args))
    for name, value in DEFAULTS.items():
        if getattr(filled, name) is None:
            setattr(filled, name, value)
    return filled


def block_bytes() -> int:
    """Bytes of one block of BLOCK_SIZE tokens of MODEL's K/V."""
    return BLOCK_SIZE * get_config(MODEL).kv_bytes_per_entry()


def least_blocks_per_device(devices: list[int]) -> int:
    """The fewest blocks per GPU that hold one token on every GPU of a group of each D of `devices`: a
    block in each of the token's rows there, every layer (the pool's own rule)."""
    config = get_config(MODEL)
    experts = config.num_attention_experts
    most = 0
    for d in devices:
        on_each = experts // (d // num_groups(d))  # a group's experts per GPU
        most = max(most, config.num_hidden_layers * min(on_each, config.num_attention_experts_per_tok))
    return most


def check_requests(args) -> None:
    """--requests (given, or a program's default) within the trace bounds of validation.py: the sweep
    builds a trace for each --devices of requests x its groups, all kept."""
    meaning = "a routing trace keeps every token's experts, about 0.2 MB a request"
    options.count("--requests", args.requests, 1, MAX_TRACE_REQUESTS, meaning=meaning)
    if args.sessions:
        return
    requests = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    groups = sum(num_groups(d) for d in args.devices)
    if requests * groups > MAX_TRACE_REQUESTS:
        given = f"--requests={requests}" if args.requests else f"--requests (default {requests})"
        raise ValueError(
            f"{given} with --devices {' '.join(map(str, args.devices))} is not allowed: the sweep builds "
            f"{groups} groups' traces of {requests} requests each, {requests * groups:,} in all; allowed: "
            f"at most {MAX_TRACE_REQUESTS:,} in all (--requests at most {MAX_TRACE_REQUESTS // groups:,} "
            f"here; {meaning})"
        )


def main(args) -> int:
    args = with_defaults(args)
    requests = args.requests or REQUESTS
    gib_per_device = args.gib_per_device or list(SESSION_GIB_PER_DEVICE if args.sessions else GIB_PER_DEVICE)
    rates = args.rates or list(SESSION_RATES if args.sessions else RATES)
    if args.sessions:
        if args.quick:
            requests = QUICK_REQUESTS
            gib_per_device = gib_per_device[:1]
            rates = rates[:1]
        result = measure_sessions(
            requests, args.devices[0], gib_per_device, rates, args.think_seconds, args.max_num_seqs, args.seed
        )
        print_sessions(result)
        if args.json:
            write(args.json, result, indent=1)  # strict JSON: no Infinity or NaN
            print(f"\nwrote {args.json}")
        return 0
    if args.quick:
        requests = QUICK_REQUESTS
        gib_per_device = gib_per_device[:1]
        rates = rates[:1]
    # D GPUs serve num_groups(D) times the requests: one trace per device count
    traces = {d: cluster_workload(requests * num_groups(d), args.workload, args.seed) for d in args.devices}
    trace = traces[args.devices[0]]
    grid = [
        (d, gib, rate, process, reservation, policy)
        for d in args.devices
        for gib in gib_per_device
        for rate in rates
        for process in args.arrivals
        for reservation in args.reservations
        for policy in args.policies
    ]
    runs = []
    for d, gib, rate, process, reservation, policy in tqdm(grid, desc="cluster", unit="run", disable=None):
        runs.append(
            run_one(traces[d], d, gib, rate, process, policy, reservation, args.max_num_seqs, args.seed)
        )
    cost = cluster_cost_model(
        get_config(MODEL), ACTIVE_PARAMS, args.devices[0] // num_groups(args.devices[0]), BLOCK_SIZE
    )
    result = {
        "model": MODEL,
        "workload": args.workload,
        "workload_source": length_workloads()[args.workload]["source"],
        "requests": requests,  # a group's: D GPUs serve num_groups(D) times as many
        "prompt_tokens_mean": float(trace.prompt_lens.double().mean()),
        "output_tokens_mean": float((trace.lengths - trace.prompt_lens + 1).double().mean()),
        "cost_model": cost.to_dict(),
        "ttft_slo_s": TTFT_SLO,
        "tpot_slo_s": TPOT_SLO,
        "gamma_cv": GAMMA_CV,
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "runs": runs,
        "where_policies_differ": where_policies_differ(runs),
        "goodput": goodput(runs),
    }
    print_tables(result)
    if args.json:
        write(args.json, result, indent=1)  # strict JSON: no Infinity or NaN
        print(f"\nwrote {args.json}")
    return 0
