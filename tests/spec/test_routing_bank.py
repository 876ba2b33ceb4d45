"""Compact routing traces (sim/traces.py): a bank of routings and a per-token index into it. A compact
trace answers every question the simulator asks (appends, decode appends, row counts, subsets, slot
counts, the runner's stats) exactly as the same trace with every token's experts written out;
distinct_routings=None leaves the generators' traces bit for bit as they were; a banked trace's
expert frequencies are close to the unbanked one's; the bank's sizes are what it promises."""

import dataclasses
import hashlib

import pytest
import torch

from moekv_ref.cache.rows import RowIndex
from moekv_ref.costs import CostModel
from moekv_ref.sim.runner import RunnerSetup, TraceRunner
from moekv_ref.sim.traces import RoutingTrace, synthetic_trace, topic_trace
from moekv_ref.validation import MAX_INT32

FREE = CostModel("free", 0.0, 0.0, 0.0, float("inf"), 0.0, 0.0, 1)


def random_compact(seed: int, S=7, L=4, E=8, K=3, B=5, threshold=True) -> RoutingTrace:
    """A compact trace on fresh random inputs: B routings of K distinct experts per layer (under
    threshold routing, each (routing, layer) keeps a random 0..K of them, padded with -1 at the end),
    sequence lengths 1..12, prompts 1..length."""
    generator = torch.Generator().manual_seed(seed)
    routings = torch.rand(B, L, E, generator=generator).argsort(-1)[..., :K]  # (B, L, K) distinct
    if threshold:
        used = torch.randint(0, K + 1, (B, L, 1), generator=generator)
        routings = torch.where(torch.arange(K) < used, routings, -1)
    lengths = torch.randint(1, 13, (S,), generator=generator)
    prompts = (torch.rand(S, generator=generator) * lengths).floor().to(torch.int64) + 1  # 1..length
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    token_routing = torch.randint(B, (int(offsets[-1]),), generator=generator, dtype=torch.int32)
    return RoutingTrace(routings.to(torch.int16), offsets, prompts, E, 4, "random", token_routing)


def materialized(trace: RoutingTrace) -> RoutingTrace:
    """The same trace with every token's experts written out, gathered here rather than by the class."""
    experts = trace.routings[trace.token_routing.to(torch.int64)]
    return RoutingTrace(
        experts, trace.offsets, trace.prompt_lens, trace.num_experts, trace.kv_bytes_per_slot, trace.name
    )


def reference_appends(full: torch.Tensor, trace, seqs, starts, counts, row_seqs) -> dict[int, int]:
    """Slots per row, token by token, from the written-out (num_tokens, L, K) experts."""
    index = RowIndex(trace.num_layers, trace.num_experts)
    slots = {}
    for i, seq in enumerate(seqs.tolist()):
        for t in range(int(starts[i]), int(starts[i] + counts[i])):
            for layer, chosen in enumerate(full[int(trace.offsets[seq]) + t].tolist()):
                for expert in chosen:
                    if expert >= 0:
                        row = index.row(int(row_seqs[i]), layer, expert)
                        slots[row] = slots.get(row, 0) + 1
    return slots


@pytest.mark.parametrize("seed", range(4))
def test_a_compact_trace_answers_like_its_materialized_form(seed):
    compact = random_compact(seed)
    full = materialized(compact)
    generator = torch.Generator().manual_seed(100 + seed)
    assert compact.token_routing is not None and full.token_routing is None
    assert torch.equal(compact.experts, full.experts)  # the costly property builds the same tensor
    assert (compact.num_layers, compact.k_max) == (full.num_layers, full.k_max) == (4, 3)
    assert compact.num_slot_appends == full.num_slot_appends == int((full.experts >= 0).sum())
    assert compact.is_top_k == full.is_top_k
    for seq in range(compact.num_sequences):
        assert torch.equal(compact.row_counts(seq), full.row_counts(seq))
        span = full.experts[int(full.offsets[seq]) : int(full.offsets[seq + 1])].to(torch.int64)
        one_hot = torch.nn.functional.one_hot(span.clamp(min=0), full.num_experts) * (span >= 0)[..., None]
        assert torch.equal(compact.row_counts(seq)[-1], one_hot.sum((0, 2)))  # (L, E) after every token
    for _ in range(5):
        seqs = torch.randperm(compact.num_sequences, generator=generator)[:4]
        lengths = compact.lengths[seqs]
        starts = (torch.rand(4, generator=generator) * lengths).floor().to(torch.int64)
        counts = ((torch.rand(4, generator=generator) * (lengths - starts)).floor() + 1).to(torch.int64)
        row_seqs = torch.randperm(20, generator=generator)[:4]  # distinct, as decoding sequences are
        for renumber in (None, row_seqs):
            got = compact.appends(seqs, starts, counts, renumber)
            want = full.appends(seqs, starts, counts, renumber)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            expected = reference_appends(
                full.experts, full, seqs, starts, counts, seqs if renumber is None else renumber
            )
            assert dict(zip(got[0].tolist(), got[1].tolist())) == expected
        got = compact.decode_appends(seqs, starts, row_seqs)
        want = full.decode_appends(seqs, starts, row_seqs)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert sorted(got[0].tolist()) == sorted(
            reference_appends(full.experts, full, seqs, starts, torch.ones_like(starts), row_seqs)
        )


@pytest.mark.parametrize("seed", range(3))
def test_a_compact_subset_keeps_the_bank_and_takes_the_right_tokens(seed):
    compact = random_compact(seed)
    full = materialized(compact)
    seqs = torch.randperm(compact.num_sequences, generator=torch.Generator().manual_seed(seed))[:4].tolist()
    part = compact.subset(seqs)
    assert part.routings is compact.routings and part.token_routing is not None  # still compact
    expected = torch.cat([full.experts[int(full.offsets[s]) : int(full.offsets[s + 1])] for s in seqs])
    assert torch.equal(part.experts, expected) and torch.equal(full.subset(seqs).experts, expected)
    assert part.lengths.tolist() == compact.lengths[seqs].tolist()
    assert part.prompt_lens.tolist() == compact.prompt_lens[seqs].tolist()
    assert part.num_slot_appends == full.subset(seqs).num_slot_appends == int((expected >= 0).sum())
    for seq in range(len(seqs)):
        assert torch.equal(part.row_counts(seq), full.subset(seqs).row_counts(seq))


def test_top_k_is_read_from_the_routings_tokens_use():
    """A routing no token uses may have -1s: the trace is still top-k, as its written-out form says."""
    compact = random_compact(0, S=3, B=200, threshold=False)
    routings = compact.routings.clone()
    unused = int(torch.ones(len(routings)).index_fill_(0, compact.token_routing.long(), 0).nonzero()[0])
    routings[unused, 0, -1] = -1
    compact = dataclasses.replace(compact, routings=routings)
    assert compact.is_top_k and materialized(compact).is_top_k
    routings = routings.clone()
    routings[int(compact.token_routing[0]), 1, -1] = -1  # a used one: no longer top-k
    compact = dataclasses.replace(compact, routings=routings)  # a trace reads is_top_k once
    assert not compact.is_top_k and not materialized(compact).is_top_k


def test_a_bad_token_routing_is_refused():
    compact = random_compact(1)
    for bad in (
        compact.token_routing[:-1],  # one token short
        compact.token_routing.to(torch.float32),
        torch.full_like(compact.token_routing, len(compact.routings)),  # past the bank
        compact.token_routing - 1,  # -1 somewhere
    ):
        with pytest.raises(ValueError, match="token_routing|offsets"):
            dataclasses.replace(compact, token_routing=bad)


def run_stats(trace: RoutingTrace, policy: str):
    generator = torch.Generator().manual_seed(3)
    placement = torch.stack(
        [torch.randperm(trace.num_experts, generator=generator) % 2 for _ in range(trace.num_layers)]
    )
    setup = RunnerSetup(blocks_per_device=60, block_size=4, max_num_seqs=12, max_num_batched_tokens=64)
    return TraceRunner(trace, placement, setup, policy, FREE).run()


def assert_same_stats(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=field.name)
        else:
            assert x == y, field.name


@pytest.mark.parametrize("policy", ["sequence_lru", "pressure_aware", "belady"])
def test_the_runner_makes_the_same_run_on_the_compact_and_the_materialized_trace(policy):
    compact, _ = topic_trace(30, 3, 8, 2, mean_prompt=8, mean_output=24, seed=1, distinct_routings=24)
    assert compact.token_routing is not None
    stats = run_stats(compact, policy)
    assert stats.num_evictions > 0, "no eviction happened: the comparison would test little"
    assert_same_stats(stats, run_stats(materialized(compact), policy))


def test_the_runner_on_a_compact_threshold_trace():
    """-1s in the bank: the runner must see fewer than K experts per token (not top-k), as on the
    written-out trace."""
    compact = random_compact(2, S=20, E=8, K=3, B=6)
    assert not compact.is_top_k
    stats = run_stats(compact, "sequence_lru")
    assert stats.num_evictions > 0
    assert_same_stats(stats, run_stats(materialized(compact), "sequence_lru"))


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def test_distinct_routings_none_leaves_the_traces_as_they_were():
    """The digests were taken before distinct_routings existed: committed numbers rest on these streams."""
    trace = synthetic_trace(16, 3, 8, 2, seed=0, distinct_routings=None)
    assert trace.token_routing is None
    assert digest(trace.experts, trace.offsets, trace.prompt_lens) == "e7dc99e7ce8cbb68"
    trace = synthetic_trace(40, 4, 16, 4, seed=3, zipf_s=1.2, mean_prompt=30)
    assert digest(trace.experts, trace.offsets, trace.prompt_lens) == "a98892150dd03760"
    trace, topic = topic_trace(40, 3, 8, 2, seed=0)
    assert trace.token_routing is None
    assert digest(trace.experts, trace.offsets, trace.prompt_lens, topic) == "9a07216da0426aef"
    trace, topic = topic_trace(100, 6, 32, 4, num_topics=5, seed=2, mean_prompt=40, distinct_routings=None)
    assert digest(trace.experts, trace.offsets, trace.prompt_lens, topic) == "c23f46119f01e9e1"


def test_a_bank_keeps_the_lengths_and_indexes_its_topic_s_routings():
    plain, topic = topic_trace(50, 3, 8, 2, num_topics=3, seed=4)
    banked, banked_topic = topic_trace(50, 3, 8, 2, num_topics=3, seed=4, distinct_routings=16)
    assert torch.equal(plain.offsets, banked.offsets) and torch.equal(plain.prompt_lens, banked.prompt_lens)
    assert torch.equal(topic, banked_topic)
    assert banked.routings.shape == (3 * 16, 3, 2) and banked.token_routing.dtype == torch.int32
    token_topic = torch.repeat_interleave(topic, banked.lengths)
    assert torch.equal(banked.token_routing.long() // 16, token_topic)  # topic t's bank: rows 16t..16t+15
    assert banked.is_top_k and (banked.routings.sort(-1).values.diff(dim=-1) > 0).all()  # distinct
    synthetic = synthetic_trace(50, 3, 8, 2, seed=4, distinct_routings=16)
    assert synthetic.routings.shape == (16, 3, 2) and int(synthetic.token_routing.max()) < 16


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64"])
def test_distinct_routings_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="distinct_routings"):
        synthetic_trace(4, 2, 8, 2, distinct_routings=bad)
    with pytest.raises(ValueError, match="distinct_routings"):
        topic_trace(4, 2, 8, 2, distinct_routings=bad)


def test_a_topic_bank_must_be_indexable_by_int32():
    with pytest.raises(ValueError, match="distinct_routings"):
        topic_trace(4, 2, 8, 2, num_topics=4, distinct_routings=MAX_INT32 // 4 + 1)


def frequencies(trace: RoutingTrace, token_topic: torch.Tensor, num_topics: int) -> torch.Tensor:
    """(T, L, E): the share of topic t's tokens that chose expert e at layer l."""
    experts = trace.experts.to(torch.int64)  # (N, L, K), top-k: no -1
    hits = torch.nn.functional.one_hot(experts, trace.num_experts).sum(2)  # (N, L, E)
    per_topic = torch.zeros(num_topics, trace.num_layers, trace.num_experts).index_add_(
        0, token_topic, hits.float()
    )
    return per_topic / torch.bincount(token_topic, minlength=num_topics)[:, None, None]


def test_a_large_bank_routes_like_the_unbanked_trace():
    """Same seed, so the same lengths, weights and topics; per topic, layer and expert the banked share
    of tokens is within 0.05 of the unbanked one. Why 0.05: the smallest of the 4 topics has about
    10^4 tokens, so each share has a standard error up to sqrt(0.25 / 10^4) = 0.005 from the tokens and
    sqrt(0.25 / 4096) = 0.008 from the bank; their difference's, about 0.011, times 4.5 covers the
    most of 96 cells. The synthetic trace's one topic has 10^5 tokens: 0.03 is about 3.7 of its
    standard errors (0.008, nearly all the bank's) for the most of 24 cells. A bank of the wrong topic,
    or of the wrong weights, is off by 0.1 or more."""
    args = dict(mean_prompt=128, mean_output=128, seed=5)
    plain, topic = topic_trace(400, 3, 8, 2, **args)
    banked, _ = topic_trace(400, 3, 8, 2, distinct_routings=4096, **args)
    token_topic = torch.repeat_interleave(topic, plain.lengths)
    assert int(torch.bincount(token_topic).min()) > 8000
    want = frequencies(plain, token_topic, 4)
    got = frequencies(banked, token_topic, 4)
    assert float((got - want).abs().max()) < 0.05
    assert float((want - want.mean(0)).abs().max()) > 0.2  # topics differ: a mix-up would show
    plain = synthetic_trace(400, 3, 8, 2, zipf_s=1.0, **args)
    banked = synthetic_trace(400, 3, 8, 2, zipf_s=1.0, distinct_routings=4096, **args)
    everyone = torch.zeros(int(plain.offsets[-1]), dtype=torch.int64)
    assert float((frequencies(banked, everyone, 1) - frequencies(plain, everyone, 1)).abs().max()) < 0.03


def test_a_fine_grained_bank_stays_small():
    """24 layers, 64 experts, top-8 at 10^4 requests: the bank is B x 24 x 8 int16 whatever the
    requests, and each token adds one int32 (the unbanked trace would add 384 bytes a token)."""
    trace = synthetic_trace(10_000, 24, 64, 8, mean_prompt=512, mean_output=256, distinct_routings=32768)
    assert trace.routings.shape == (32768, 24, 8) and trace.routings.dtype == torch.int16
    assert (trace.num_layers, trace.k_max) == (24, 8)
    assert trace.token_routing.shape == (int(trace.offsets[-1]),) and trace.token_routing.dtype == torch.int32
    assert trace.num_slot_appends == int(trace.offsets[-1]) * 24 * 8 and trace.is_top_k
