"""A step happens whole or not at all: a fault at any call a step makes leaves the engine able to
step on, with nothing lost and nothing leaked, and every request gets the tokens it gets alone.

- Fault injection at every call site of a step: each site in SITES raises once, at its k-th call
  (k = 1, 2, 4), and the run goes on to the end. The workload (prefix caching, preemption by swap,
  optimistic admission, a tight pool) reaches every site; a site that never raised fails the test.
- Fault injection at every line from the forward's return to the step's end (the hand-out and the
  step's records included): each line the engine's own code runs there raises once, in its own run
  (a trace function raises into the line), as an exception, Ctrl-C or MemoryError; the scheduler
  and the generators come back as they were when the forward started, nothing is handed out.
- Prefix caching under tight pools: 60 seeded runs, from the smallest pool the engine accepts for
  the workload up, each serving the same prompts twice (the second time from the cache): 0 lost
  requests, 0 leaked blocks, the tokens of generating alone. And the case that once lost a request:
  the embedded model, one short prompt twice, pools of 36-57 blocks.
- The default pool of generate(cache="paged") is worst-case sized: the longest prompt the model
  accepts runs without num_blocks.
"""

import enum
import sys
from collections import deque

import numpy as np
import pytest
import torch
from helpers import alone_tokens, random_model, random_prompts, small_config

import moekv_ref.engine.engine as engine_module
import moekv_ref.sampling as sampling_module
from moekv_ref.checkpoint import load_default_model
from moekv_ref.engine import LLMEngine, SchedulerConfig, undo
from moekv_ref.engine.request import RequestOutput
from moekv_ref.engine.swap import SWAP_OUT
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams

BLOCK_SIZE = 4
FAULT_POOL = 92  # blocks: the workload below swaps 4 times, hits and copies (the smallest it allows: 72)
# 5 requests (8 before; with the same pool: 59 steps instead of 92): they still swap out and in 4
# times each, the most any site needs (a fault at call 4); `raised` checks each site's call was made,
# and test_the_workload_preempts_swaps_and_hits the preemptions, swaps, hits and copies.
FAULT_REQUESTS = 5


class InjectedFault(RuntimeError):
    pass


def shared_prefix_workload(num_requests=8, seed=5, min_new_tokens=14):
    """Prompts sharing prefixes of varied lengths, then a few tokens of their own; every other request
    greedy, the others sampled with their own seed."""
    shared = random_prompts([30], 64, seed=seed)[0]
    own = random_prompts([2 + i % 4 for i in range(num_requests)], 64, seed=seed + 1)
    prompts = [shared[: 12 + 3 * (i % 5)] + tail for i, tail in enumerate(own)]
    params = [
        SamplingParams(
            max_new_tokens=min_new_tokens + i % 5, temperature=0.0 if i % 2 else 1.0, top_p=0.9, seed=i
        )
        for i in range(num_requests)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def model():
    return random_model(small_config("expert", "threshold"), seed=0)


@pytest.fixture(scope="module")
def workload():
    return shared_prefix_workload(FAULT_REQUESTS)


@pytest.fixture(scope="module")
def alone(model, workload):
    return alone_tokens(model, *workload)


def make_engine(model, num_blocks, mode="swap", admission="optimistic", max_num_seqs=4, **options):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=32, preemption_mode=mode, admission=admission
    )
    return LLMEngine(model, num_blocks, BLOCK_SIZE, config, enable_prefix_caching=True, **options)


def serve_twice(engine, prompts, params):
    """Every prompt served twice, the second time after the first finished (so from the cache); each
    step that raises InjectedFault is stepped on. Returns (outputs by request id, faults seen)."""
    outputs, faults = {}, 0
    for _ in range(2):
        for p, q in zip(prompts, params):
            engine.add_request(p, q)
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            assert steps < 2000, "the engine does not make progress"
            try:
                for output in engine.step():
                    outputs[output.request_id] = output
            except InjectedFault:
                faults += 1
                queued = [*engine.scheduler.waiting, *engine.scheduler.running]
                assert all(engine.requests.get(r.request_id) is r for r in queued), (
                    "an unfinished request left"
                )
    return outputs, faults


def check_served(engine, outputs, alone):
    num = len(alone)
    assert sorted(outputs) == list(range(2 * num)), "a request was lost"
    for request_id, output in outputs.items():
        assert output.finish_reason == "length", (request_id, output.finish_reason)
        assert output.token_ids == alone[request_id % num], request_id
    assert not engine.has_unfinished_requests()
    engine.memory.assert_no_leak()
    engine.cache.manager.assert_consistent()


# every call a step makes, as (what it is, how to reach the object that makes it, method name)
SITES = [
    ("victim policy", lambda e: e.scheduler.victims, "choose_victim"),
    ("admission policy", lambda e: e.scheduler.batching.admission, "allows"),
    ("demand prediction at admission", lambda e: e.scheduler.predictor, "predict"),
    ("demand predictor's observe", lambda e: e.scheduler.predictor, "observe"),
    ("step demand (token counts)", lambda e: e.scheduler.memory, "token_counts"),
    ("swap out", lambda e: e.scheduler.swap_space, "swap_out"),
    ("swap in", lambda e: e.scheduler.swap_space, "swap_in"),
    ("prefix lookup", lambda e: e.cache.manager.prefix_cache, "find_cached_prefix"),
    ("prefix hit applied", lambda e: e.cache.manager.prefix_cache, "apply_prefix_hit"),
    ("prefix registration", lambda e: e.cache.manager.prefix_cache, "cache_computed_blocks"),
    ("blocks freed (preempt, finish)", lambda e: e.cache.manager, "free"),
    ("batching policy's release", lambda e: e.scheduler.batching, "release"),
    ("block copies", lambda e: e.runner, "copy_blocks"),
    ("forward", lambda e: e.runner, "forward"),
    ("append_kv (a layer's bookkeeping)", lambda e: e.cache, "append_kv"),
    ("attend (a layer's attention)", lambda e: e.cache, "attend"),
    ("hand-out of a finished request", lambda e: e, "_hand_out"),
    ("what the step's records were (kept for an undo)", lambda e: e, "_records"),
    ("the step's records", lambda e: e, "_end_step"),
]


def inject(obj, method: str, at_call: int) -> list:
    """Make obj.method raise InjectedFault at its at_call-th call (once). Returns a list that gets one
    entry when it raised."""
    original = getattr(obj, method)
    calls, raised = [0], []

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call and not raised:
            raised.append(calls[0])
            raise InjectedFault(f"{method}, call {at_call}")
        return original(*args, **kwargs)

    setattr(obj, method, faulty)
    return raised


@pytest.mark.parametrize("site, reach, method", SITES, ids=[s[0] for s in SITES])
def test_a_fault_at_every_call_site_of_a_step_is_undone(model, workload, alone, site, reach, method):
    prompts, params = workload
    for at_call in (1, 2, 4):
        engine = make_engine(model, FAULT_POOL, max_num_seqs=6)
        raised = inject(reach(engine), method, at_call)
        outputs, faults = serve_twice(engine, prompts, params)
        assert raised, f"{site}: the workload never made its call number {at_call}"
        assert faults == 1 and engine.stats().num_failed_steps == 1
        check_served(engine, outputs, alone)


def test_the_workload_preempts_swaps_and_hits(model, workload, alone):
    """What makes the fault sites above reachable: the unbroken run swaps, preempts and hits."""
    engine = make_engine(model, FAULT_POOL, max_num_seqs=6)
    outputs, _ = serve_twice(engine, *workload)
    check_served(engine, outputs, alone)
    stats, hits = engine.stats(), engine.prefix_cache_stats()
    assert stats.num_preemptions >= 4 and stats.num_swapped_out_blocks > 0  # a fault at swap call 4
    assert hits["num_hit_tokens"] > 0 and hits["num_cow_blocks"] > 0


@pytest.mark.parametrize("kind, expected", [("plain decode", 1), ("preempting", 2)])
def test_a_fault_in_the_forward_is_undone_from_the_snapshot_that_still_holds(
    model, workload, alone, kind, expected, monkeypatch
):
    """A step snapshots the scheduler before scheduling, and again before the forward only if
    scheduling moved a request or freed a block (the blocks it freed may take the forward's K/V):
    a fault just after the forward of a plain decode step (one snapshot) and of a step that
    preempted by recompute (two) is undone, and every request gets its tokens of generating alone."""
    snapshots, decisions, taken = [], [], []
    original = engine_module.Snapshot
    monkeypatch.setattr(
        engine_module,
        "Snapshot",
        type(
            "Counted",
            (original,),
            {"__init__": lambda self, root: snapshots.append(1) or original.__init__(self, root)},
        ),
    )
    engine = make_engine(model, FAULT_POOL, mode="recompute", max_num_seqs=6)  # it preempts by recompute
    schedule, forward = engine.scheduler.schedule, engine.runner.forward
    engine.scheduler.schedule = lambda step, retry=None: (
        decisions.append((len(snapshots), schedule(step, retry))) or decisions[-1][1]
    )

    def faulty_forward(scheduled):
        before, d = decisions[-1]  # snapshots before this step's schedule: one of them
        plain = not (d.events or d.evictions or d.block_copies) and all(
            s.num_tokens == 1 for s in d.scheduled
        )
        result = forward(scheduled)  # then the fault: the step's K/V is written
        if not taken and engine.step_count > 2 and (plain if kind == "plain decode" else bool(d.preempted)):
            taken.append(len(snapshots) - before + 1)
            raise InjectedFault("after the forward")
        return result

    engine.runner.forward = faulty_forward
    outputs, faults = serve_twice(engine, *workload)
    assert taken == [expected] and faults == 1 and engine.stats().num_failed_steps == 1
    check_served(engine, outputs, alone)


def test_a_fault_while_scheduling_names_the_request_and_keeps_it_queued(model, workload):
    prompts, params = workload
    engine = make_engine(model, FAULT_POOL)
    inject(engine.scheduler.predictor, "predict", 1)
    engine.add_request(prompts[0], params[0])
    with pytest.raises(InjectedFault) as fault:
        engine.step()
    assert any("request 0" in note for note in fault.value.__notes__)
    assert [r.request_id for r in engine.scheduler.waiting] == [0] and not engine.scheduler.running
    assert engine.memory.num_used_blocks == 0
    engine.abort_request(0)  # it is still there to abort
    engine.memory.assert_no_leak()


def test_the_sampler_failing_fails_its_request_alone(model, workload, alone, monkeypatch):
    """Sampling is the request's own: a fault there finishes that request with finish_reason "error"
    (not the step), and the others are served."""
    prompts, params = workload
    original, calls = sampling_module._sample_next, [0]

    def sample_next(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise InjectedFault("sampling")
        return original(*args)

    monkeypatch.setattr(sampling_module, "_sample_next", sample_next)
    engine = make_engine(model, FAULT_POOL)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    failed = [i for i in ids if outputs[i].finish_reason == "error"]
    assert len(failed) == 1
    assert all(outputs[i].token_ids == alone[i] for i in ids if i not in failed)
    engine.memory.assert_no_leak()


# ----- prefix caching under tight pools --------------------------------------------------------------
@pytest.fixture(scope="module")
def short_workload():
    return shared_prefix_workload(6, seed=7, min_new_tokens=4)


@pytest.fixture(scope="module")
def short_alone(model, short_workload):
    return alone_tokens(model, *short_workload)


@pytest.mark.parametrize("seed", range(60))
def test_prefix_caching_with_tight_pools_loses_nothing(model, short_workload, short_alone, seed):
    prompts, params = short_workload
    alone = short_alone
    probe = make_engine(model, 1000)
    smallest = max(
        probe.scheduler.max_blocks_alone(len(p) + q.max_new_tokens - 1) for p, q in zip(prompts, params)
    )
    generator = torch.Generator().manual_seed(seed)
    num_blocks = smallest + int(torch.randint(0, 40, (1,), generator=generator)) if seed else smallest
    mode = ("recompute", "swap")[seed % 2]
    admission = ("optimistic", "predicted")[(seed // 2) % 2]
    engine = make_engine(model, num_blocks, mode, admission, max_num_seqs=2 + seed % 4)
    outputs, faults = serve_twice(engine, prompts, params)
    assert faults == 0
    check_served(engine, outputs, alone)


def test_the_embedded_model_serves_a_prompt_twice_from_the_cache_in_every_small_pool():
    model = load_default_model()
    prompt = list(b"import os\nimport ")
    params = SamplingParams(max_new_tokens=2, temperature=0)
    expected = generate(model, [prompt], params).tokens[0]
    for num_blocks in range(36, 58):
        engine = LLMEngine(model, num_blocks=num_blocks, block_size=16, enable_prefix_caching=True)
        first = engine.generate([prompt], params)
        second = engine.generate([prompt], params)
        assert first[0].token_ids == second[0].token_ids == expected, num_blocks
        assert not engine.has_unfinished_requests()
        engine.memory.assert_no_leak()


# ----- the default pool ------------------------------------------------------------------------------
def test_the_default_paged_pool_holds_the_longest_prompts_the_model_accepts():
    """Without num_blocks, generate(cache="paged") sizes its pool for the worst case: every token in
    k_max experts of every layer, each row's last block partly filled."""
    model = load_default_model()
    longest = model.config.max_position_embeddings
    prompts = random_prompts([longest - 1, longest - 12], model.config.vocab_size, seed=1)
    params = SamplingParams(max_new_tokens=1, temperature=0)
    paged = generate(model, prompts, params, cache="paged")
    assert paged.tokens == generate(model, prompts, params, cache="contiguous").tokens


def test_abort_takes_the_integer_kinds_add_request_takes(model, workload):
    engine = make_engine(model, FAULT_POOL)
    request_id = engine.add_request(*[x[0] for x in workload])
    assert engine.abort_request(np.int64(request_id)).finish_reason == "aborted"
    for bad in (0.0, True, "0"):
        with pytest.raises(
            ValueError, match=r"allowed: an integer >= 0 \(the id of a request of this engine"
        ):
            engine.abort_request(bad)


def _everything(root) -> dict:
    """Every attribute of every object of this package reachable from `root` (the scheduler), by
    path, as comparable values: what a snapshot must give back. Reflection is fine here: this is
    the check that the classes' STATE lists (moekv_ref/state.py) miss nothing."""
    found, seen = {}, set()

    def value(v, path):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, tuple(v.shape), v.clone())
        if isinstance(v, (list, tuple, deque)):
            return (type(v).__name__, [value(x, f"{path}[{i}]") for i, x in enumerate(v)])
        if isinstance(v, set):
            return ("set", sorted(map(repr, v)))
        if isinstance(v, dict):
            return ("dict", [(repr(k), value(x, f"{path}[{k!r}]")) for k, x in v.items()])
        is_ours = type(v).__module__.startswith("moekv_ref.") and hasattr(v, "__dict__")
        if not is_ours or isinstance(v, (enum.Enum, torch.nn.Module)):
            return (
                v if isinstance(v, (int, float, str, bytes, bool, type(None), enum.Enum)) else ("id", id(v))
            )
        if id(v) not in seen:
            seen.add(id(v))
            found[path] = {k: value(x, f"{path}.{k}") for k, x in vars(v).items() if not callable(x)}
        return ("object", id(v))

    value(root, "scheduler")
    return found


def _same(a, b) -> bool:
    if isinstance(a, tuple) and a[:1] == ("tensor",):
        return isinstance(b, tuple) and b[:3] == a[:3] and torch.equal(a[3], b[3])
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _differences(before: dict, after: dict) -> list[str]:
    return [
        f"{path}.{name}"
        for path, attributes in before.items()
        for name, saved in attributes.items()
        if path not in after or name not in after[path] or not _same(saved, after[path][name])
    ]


# a fault in the block copies is not undone from a snapshot: the sequences they moved recompute
UNDONE_SITES = [s for s in SITES if s[2] != "copy_blocks"]


@pytest.mark.parametrize("site, reach, method", UNDONE_SITES, ids=[s[0] for s in UNDONE_SITES])
def test_an_undone_step_gives_back_every_attribute_the_snapshot_saw(
    model, workload, site, reach, method, monkeypatch
):
    """Each Snapshot compared, attribute by attribute over every object the scheduler reaches, with
    what its restore leaves: equal, so no class's STATE list misses what a step changes."""
    restores = []
    original_init, original_restore = undo.Snapshot.__init__, undo.Snapshot.restore

    def remembering_init(self, scheduler):
        self.everything_before = _everything(scheduler)
        original_init(self, scheduler)

    def comparing_restore(self):
        restoring = self._saved is not None
        original_restore(self)
        if restoring:
            restores.append((site, _differences(self.everything_before, _everything(self._scheduler))))

    monkeypatch.setattr(undo.Snapshot, "__init__", remembering_init)
    monkeypatch.setattr(undo.Snapshot, "restore", comparing_restore)
    engine = make_engine(model, FAULT_POOL, max_num_seqs=6)
    inject(reach(engine), method, 2)
    prompts, params = workload
    serve_twice(engine, prompts, params)
    assert restores, f"{site}: no step was undone"
    assert all(not differences for _, differences in restores), restores


@pytest.mark.parametrize("fault", [InjectedFault, KeyboardInterrupt])
def test_a_request_whose_hand_out_fails_is_handed_out_by_a_later_step(
    model, workload, alone, fault, monkeypatch
):
    """An exception or Ctrl-C while a finished request's output is made (RequestOutput.from_request)
    undoes the step, the forward included: the request is unfinished again, stays in
    engine.requests, and a later step hands it out with the tokens it gets alone."""
    original = RequestOutput.from_request.__func__
    calls = [0]

    def faulty(cls, request):
        calls[0] += 1
        if calls[0] == 2:
            raise fault("while handing out")
        return original(cls, request)

    monkeypatch.setattr(RequestOutput, "from_request", classmethod(faulty))
    engine = make_engine(model, FAULT_POOL, max_num_seqs=6)
    prompts, params = workload
    for p, q in zip(prompts, params):
        engine.add_request(p, q)
    outputs, faults = {}, 0
    while engine.has_unfinished_requests():
        try:
            for output in engine.step():
                outputs[output.request_id] = output
        except fault as error:
            faults += 1
            assert any("the step was undone" in note for note in error.__notes__)
            unfinished = [r for r in engine.requests.values() if not r.is_finished]
            assert unfinished and engine.has_unfinished_requests()
    assert faults == 1
    assert sorted(outputs) == list(range(len(prompts))) and not engine.requests
    assert [outputs[i].token_ids for i in range(len(prompts))] == alone
    engine.memory.assert_no_leak()


def test_an_abort_whose_hand_out_fails_changes_nothing(model, workload, monkeypatch):
    engine = make_engine(model, FAULT_POOL)
    prompts, params = workload
    request_id = engine.add_request(prompts[0], params[0])
    engine.step()
    free_before = engine.memory.num_free_blocks

    def faulty(cls, request):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(RequestOutput, "from_request", classmethod(faulty))
        with pytest.raises(KeyboardInterrupt):
            engine.abort_request(request_id)
    assert not engine.requests[request_id].is_finished and engine.has_unfinished_requests()
    assert engine.memory.num_free_blocks == free_before
    assert engine.abort_request(request_id).finish_reason == "aborted"
    engine.memory.assert_no_leak()


def test_a_fault_after_a_step_handed_requests_out_takes_them_back(model, workload, alone):
    """A fault in the step's last records, after it handed requests out, undoes the hand-out too:
    those requests are unfinished again and in engine.requests (the engine keeps no history here, so
    the hand-out had removed them), and a later step hands them out with the tokens they get alone."""
    engine = make_engine(model, FAULT_POOL, max_num_seqs=6)
    handed, raised = [], []
    hand_out, end_step = engine._hand_out, engine._end_step

    def recording_hand_out(request, step):
        handed.append(request.request_id)
        return hand_out(request, step)

    def faulty_end_step(*args):
        if handed and not raised:
            raised.append(list(handed))
            raise InjectedFault("after the hand-out")
        handed.clear()
        return end_step(*args)

    engine._hand_out = recording_hand_out
    engine._end_step = faulty_end_step
    prompts, params = workload
    for p, q in zip(prompts, params):
        engine.add_request(p, q)
    outputs = {}
    while engine.has_unfinished_requests():
        try:
            for output in engine.step():
                outputs[output.request_id] = output
        except InjectedFault:
            taken_back = [engine.requests.get(i) for i in raised[0]]
            assert all(r is not None and not r.is_finished for r in taken_back), raised
        handed.clear()
    assert raised and sorted(outputs) == list(range(len(prompts)))
    assert [outputs[i].token_ids for i in range(len(prompts))] == alone
    engine.memory.assert_no_leak()


# ----- a fault at every line from the forward to the step's commit ------------------------------------
ENGINE_FILE = engine_module.__file__


class LineFaults:
    """engine.step() with every line the engine's own code (engine.py) executes from the return of
    the forward of step `at_step` to the step's end listed in `lines`, as (function, line number);
    with `at_line`, `fault` is raised there (counted from 1, each execution of a line once), as if
    the line raised it: a trace function's exception enters the frame it traces. A seeded program
    runs the same lines every time, so a run without a fault lists the lines of the runs with one.
    `before` is what the scheduler reaches when that forward starts (`_everything`), and each
    request's sampling generator state."""

    def __init__(self, engine, at_step: int | None, at_line: int | None = None, fault=InjectedFault):
        """at_step None: every step's lines, in `lines_per_step`, and no fault."""
        self.engine, self.at_step, self.at_line, self.fault = engine, at_step, at_line, fault
        self.lines_per_step, self.armed, self.raised, self.before = {}, False, False, None
        forward = engine.runner.forward

        def armed_after(scheduled):
            step = engine.step_count
            if step == at_step:
                self.before = (_everything(engine.scheduler), _generator_states(engine))
            result = forward(scheduled)
            self.armed = at_step in (None, step)
            self.lines_per_step[step] = []
            return result

        engine.runner.forward = armed_after

    @property
    def lines(self) -> list:
        return self.lines_per_step.get(self.at_step, [])

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename == ENGINE_FILE else None

    def _local(self, frame, event, arg):
        if event == "line" and self.armed:
            lines = self.lines_per_step[max(self.lines_per_step)]
            lines.append((frame.f_code.co_name, frame.f_lineno))
            if len(lines) == self.at_line:
                self.armed, self.raised = False, True
                raise self.fault(f"line {frame.f_lineno} ({frame.f_code.co_name})")
        return self._local

    def step(self) -> list:
        if self.at_step not in (None, self.engine.step_count):
            return self.engine.step()
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            return self.engine.step()
        finally:
            sys.settrace(previous)
            self.armed = False


def _generator_states(engine) -> dict:
    return {i: r.generator.get_state() for i, r in engine.requests.items() if not r.is_finished}


@pytest.fixture(scope="module")
def line_workload(short_workload):
    """Three requests, two at a time (the third waits for a slot)."""
    prompts, params = short_workload
    return prompts[:3], params[:3]


@pytest.fixture(scope="module")
def line_alone(short_alone):
    return short_alone[:3]


def serve_with_line_fault(model, workload, at_step, at_line=None, fault=InjectedFault, **options):
    """Serve the workload to the end, step `at_step` through LineFaults, stepping on past its fault.
    Returns (engine, outputs by request id, the LineFaults, (requests, stats) before and after the
    faulted step or None)."""
    engine = make_engine(model, FAULT_POOL, max_num_seqs=2, **options)
    faults = LineFaults(engine, at_step, at_line, fault)
    for p, q in zip(*workload):
        engine.add_request(p, q)
    outputs, left = {}, None
    while engine.has_unfinished_requests():
        assert engine.step_count < 100, "the engine does not make progress"
        requests, stats = dict(engine.requests), engine.stats()
        try:
            for output in faults.step():
                outputs[output.request_id] = output
        except fault as error:
            assert faults.raised and left is None, "a fault of the kind injected came from elsewhere"
            assert any("the step was undone" in note for note in error.__notes__)
            left = (requests, stats, dict(engine.requests), engine.stats())
            faults.after = (_everything(engine.scheduler), _generator_states(engine))
    return engine, outputs, faults, left


def check_line_fault_undone(engine, faults, left, at_line):
    where = f"fault at {faults.lines[at_line - 1]}, line event {at_line}"
    assert faults.raised and left is not None, where
    requests, stats, requests_after, stats_after = left
    # nothing lost, nothing handed out: the same requests, none finished by the undone step
    assert requests_after == requests, where
    assert [r.is_finished for r in requests_after.values()] == [r.is_finished for r in requests.values()]
    # its admissions and preemptions are kept (scheduling is not undone), the rest of its counts not
    counted = {**stats.to_dict(), "num_failed_steps": stats.num_failed_steps + 1}
    for name in ("num_finished", "num_failed", "num_generated_tokens", "num_failed_steps"):
        assert stats_after.to_dict()[name] == counted[name], (where, name)
    # the scheduler (queues, requests, cache, pool, swap space, ...) and the generators as they were
    # when the forward started
    (everything, generators), (everything_after, generators_after) = faults.before, faults.after
    assert not _differences(everything, everything_after), where
    assert generators.keys() == generators_after.keys(), where
    assert all(torch.equal(generators[i], generators_after[i]) for i in generators), where


@pytest.mark.parametrize("history", [False, True], ids=["counters", "history"])
@pytest.mark.parametrize(
    "kinds", [(InjectedFault,), (KeyboardInterrupt, MemoryError)], ids=["exception", "interrupt"]
)
def test_a_fault_at_any_line_between_the_forward_and_the_commit_is_undone(
    model, line_workload, line_alone, history, kinds
):
    """Every line the engine executes from the forward's return to the end of a step that finishes
    requests (the sampling's bookkeeping, the step's records, each hand-out, the counts and the
    history) raises, once per run: an exception, or Ctrl-C and MemoryError in turn. The step is
    undone, the forward included. Nothing is lost: the requests that step finished are unfinished
    again and still in engine.requests, the counts are the ones before the step (but the failed
    step's), the scheduler and the generators are as at the forward's start, and stepping on serves
    every request with the tokens it gets alone, leaking no block."""
    # a run without a fault: the step whose end runs the most lines (it finishes requests)
    _, outputs, dry, _ = serve_with_line_fault(model, line_workload, None, record_history=history)
    assert [outputs[i].token_ids for i in range(3)] == line_alone
    at_step = max(dry.lines_per_step, key=lambda step: len(dry.lines_per_step[step]))
    lines = dry.lines_per_step[at_step]
    functions = {function for function, _ in lines}
    assert {"_run", "_records", "_event", "_hand_out", "_end_step"} <= functions, functions
    for at_line in range(1, len(lines) + 1):
        fault = kinds[at_line % len(kinds)]
        engine, outputs, faults, left = serve_with_line_fault(
            model, line_workload, at_step, at_line, fault, record_history=history
        )
        check_line_fault_undone(engine, faults, left, at_line)
        assert faults.lines == lines[:at_line], "the run took another path before its fault"
        assert sorted(outputs) == [0, 1, 2] and engine.stats().num_failed_steps == 1
        assert [outputs[i].token_ids for i in range(3)] == line_alone, at_line
        engine.memory.assert_no_leak()
        engine.cache.manager.assert_consistent()


# ----- a fault at every line from the schedule to the forward, the block copies included -------------
class ScheduleLineFaults(LineFaults):
    """LineFaults over another region: the lines engine.py executes from the return of `schedule` at
    step `at_step` to the start of its forward, the block copies included (a swap-out's copy to the
    host and a swap-in's back)."""

    def __init__(self, engine, at_step: int | None, at_line: int | None = None, fault=InjectedFault):
        self.engine, self.at_step, self.at_line, self.fault = engine, at_step, at_line, fault
        self.lines_per_step, self.armed, self.raised, self.before = {}, False, False, None
        self.copies_per_step = {}
        schedule, forward = engine.scheduler.schedule, engine.runner.forward

        def armed_after(step, retry=None):
            decision = schedule(step, retry)
            self.armed = at_step in (None, step)
            self.lines_per_step[step] = []
            self.copies_per_step[step] = sorted(copy.direction for copy in decision.block_copies)
            return decision

        def disarmed_before(scheduled):
            self.armed = False
            return forward(scheduled)

        engine.scheduler.schedule = armed_after
        engine.runner.forward = disarmed_before


@pytest.mark.parametrize(
    "kinds", [(InjectedFault,), (KeyboardInterrupt, MemoryError)], ids=["exception", "interrupt"]
)
def test_a_fault_at_any_line_between_the_schedule_and_the_forward_loses_nothing(
    model, workload, alone, kinds
):
    """Every line the engine executes between scheduling a step that swaps sequences out and in and
    that step's forward raises, once per run. Before the copies start, the step is undone whole (its
    scheduling too); once they have started, the sequences they move recompute. Either way nothing is
    lost: stepping on serves every request with the tokens it gets alone, leaking no block. (Before,
    a fault between the schedule and the copies kept a swap-out whose copy never ran.)"""

    def serve(at_step, at_line=None, fault=InjectedFault):
        engine = make_engine(model, FAULT_POOL, max_num_seqs=6)
        faults = ScheduleLineFaults(engine, at_step, at_line, fault)
        for p, q in zip(*workload):
            engine.add_request(p, q)
        outputs = {}
        while engine.has_unfinished_requests():
            assert engine.step_count < 200, "the engine does not make progress"
            try:
                for output in faults.step():
                    outputs[output.request_id] = output
            except fault as error:
                assert faults.raised, "a fault of the kind injected came from elsewhere"
                assert any("the step was undone" in note for note in error.__notes__)
        return engine, outputs, faults

    _, outputs, dry = serve(None)
    assert [outputs[i].token_ids for i in range(len(alone))] == alone
    swapping = [step for step, kinds_of in dry.copies_per_step.items() if SWAP_OUT in kinds_of]
    assert swapping, "no step swapped a sequence out: the copies would not be tested"
    at_step = max(swapping, key=lambda step: len(dry.lines_per_step[step]))
    lines = dry.lines_per_step[at_step]
    assert {"step"} <= {function for function, _ in lines}
    for at_line in range(1, len(lines) + 1):
        engine, outputs, faults = serve(at_step, at_line, kinds[at_line % len(kinds)])
        where = f"fault at {lines[at_line - 1]}, line event {at_line}"
        assert faults.raised and faults.lines == lines[:at_line], where
        assert engine.stats().num_failed_steps == 1, where
        assert [outputs[i].token_ids for i in range(len(alone))] == alone, where
        engine.memory.assert_no_leak()
        engine.cache.manager.assert_consistent()
