"""Routing traces: which attention experts each token of each sequence went to, at every layer.

A trace is all the cache needs of a run: a token routed to expert e at layer l appends one slot to
row (sequence, l, e). Expert ids, not a (T, L, E) mask, keep a real-model-shaped trace small (64
sequences x 512 tokens x 16 layers x top-8 is 4M int16). `synthetic_trace` gives every sequence
one expert popularity, `topic_trace` each its topic's.

A trace may carry token ids (`token_ids`): then sequences that begin with the same tokens share a
prefix a prefix cache can find (`conversation_turns` makes the turns of multi-turn sessions, each
turn's sequence the whole conversation so far, and its routing that of the same tokens); without
them every prompt is placeholder tokens and nothing is shared.

At 10^5 requests even expert ids are too much (7.7e7 tokens x 24 layers x top-8 is 29 GB of int16),
so a trace can also be compact: a bank of B routings (B, L, K) and, per token, the index of its
routing in the bank (`distinct_routings` of the two generators; RoutingTrace.token_routing).

Dimension legend: S sequences, L layers, E experts, K experts per token (k_max), T topics, B routings
of a compact trace's bank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..cache.rows import RowIndex
from ..validation import MAX_INT32, check_int


@dataclass
class RoutingTrace:
    """Sequences concatenated: token t's experts are routings[t], or routings[token_routing[t]] in
    the compact form. Read a few tokens' experts with `experts_of`; `experts` builds every token's."""

    routings: torch.Tensor  # (num_tokens, L, K) int16, one per token, or (B, L, K) when token_routing
    # is given; -1: a token used fewer than K (threshold routing)
    offsets: torch.Tensor  # (S + 1,) int64: sequence s is tokens offsets[s]:offsets[s + 1]
    prompt_lens: torch.Tensor  # (S,) int64: the first prompt_lens[s] tokens prefill at once
    num_experts: int  # E
    kv_bytes_per_slot: int  # bytes of K and V one token stores in one (layer, expert) row
    name: str = "trace"
    # (num_tokens,) int32 (int64 accepted) rows of routings, one per token; None: routings is per token
    token_routing: torch.Tensor | None = None
    # (num_tokens,) int64 the tokens themselves (a request's prompt, and what it samples); None: none
    # given (placeholders: no two requests share a prefix a prefix cache could find)
    token_ids: torch.Tensor | None = None

    def __post_init__(self):
        if self.routings.dim() != 3:
            raise ValueError(f"routings must be (tokens or B, L, K), got shape {tuple(self.routings.shape)}")
        index = self.token_routing
        if index is not None and (
            index.dim() != 1
            or index.dtype not in (torch.int32, torch.int64)
            or (index.numel() > 0 and (int(index.min()) < 0 or int(index.max()) >= len(self.routings)))
        ):
            raise ValueError(
                f"token_routing must be (num_tokens,) int32 or int64 indices into the {len(self.routings)} "
                f"routings; got shape {tuple(index.shape)}, {index.dtype}"
            )
        num_tokens = self.routings.shape[0] if index is None else index.numel()
        if int(self.offsets[-1]) != num_tokens:
            raise ValueError("offsets[-1] must equal the number of tokens")
        if (self.prompt_lens < 1).any() or (self.prompt_lens > self.lengths).any():
            raise ValueError("every prompt needs 1 <= prompt_len <= sequence length")
        ids = self.token_ids
        if ids is not None and (ids.shape != (num_tokens,) or ids.dtype != torch.int64):
            raise ValueError(
                f"token_ids must be ({num_tokens},) int64, one per token; got shape "
                f"{tuple(ids.shape)}, {ids.dtype}"
            )

    def experts_of(self, tokens: torch.Tensor | slice) -> torch.Tensor:
        """(n, L, K) int16: the experts of the given tokens (indices or a slice of the concatenation)."""
        if isinstance(tokens, slice):
            return (
                self.routings[tokens]
                if self.token_routing is None
                else self._bank(self.token_routing[tokens])
            )
        if self.token_routing is None:
            return self.routings.index_select(0, tokens)  # a few times faster than routings[tokens]
        return self._bank(self.token_routing.index_select(0, tokens))

    def _bank(self, routing: torch.Tensor) -> torch.Tensor:
        return self.routings.index_select(0, routing.to(torch.int64))

    @property
    def experts(self) -> torch.Tensor:
        """(num_tokens, L, K) int16: every token's experts. Costly for a compact trace (it builds the
        whole per-token tensor the bank avoids); the simulator's paths read `experts_of`."""
        return self.experts_of(slice(None))

    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.numel()

    @property
    def num_layers(self) -> int:
        return self.routings.shape[1]

    @property
    def k_max(self) -> int:
        """K: the most experts a token takes at one layer."""
        return self.routings.shape[2]

    @cached_property
    def is_top_k(self) -> bool:
        """Every token took all K experts at every layer (top-k routing, no -1); read once (the
        appends of every step skip their masks where it holds)."""
        full = (self.routings >= 0).all(2).all(1)  # (tokens or B,)
        return bool(full.all() if self.token_routing is None else full[self.token_routing].all())

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def num_slot_appends(self) -> int:
        """Slots the whole trace writes: one per (token, layer, selected expert)."""
        if self.token_routing is None:
            return int((self.routings >= 0).sum())
        slots = (self.routings >= 0).sum((1, 2))  # (B,)
        return int((torch.bincount(self.token_routing, minlength=len(self.routings)) * slots).sum())

    def subset(self, seqs: list[int]) -> "RoutingTrace":
        """The trace of some sequences only, renumbered 0..len(seqs)-1 (a compact one shares the bank)."""
        per_token = self.routings if self.token_routing is None else self.token_routing
        parts = torch.cat([per_token[self.offsets[s] : self.offsets[s + 1]] for s in seqs])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), self.lengths[seqs].cumsum(0)])
        ids = self.token_ids
        return RoutingTrace(
            parts if self.token_routing is None else self.routings,
            offsets,
            self.prompt_lens[seqs].clone(),
            self.num_experts,
            self.kv_bytes_per_slot,
            self.name,
            None if self.token_routing is None else parts,
            None if ids is None else torch.cat([ids[self.offsets[s] : self.offsets[s + 1]] for s in seqs]),
        )

    def tokens_of(self, seq: int, start: int, end: int) -> list[int]:
        """Token ids start .. end - 1 of sequence `seq` (0 where the trace carries none, and past its
        last stored token: the one a request samples last is never computed)."""
        if self.token_ids is None:
            return [0] * (end - start)
        first, length = int(self.offsets[seq]), int(self.offsets[seq + 1] - self.offsets[seq])
        stored = self.token_ids[first + start : first + min(end, length)].tolist()
        return stored + [0] * (end - start - len(stored))

    def row_counts(self, seq: int) -> torch.Tensor:
        """(len + 1, L, E): tokens each row of sequence `seq` holds after its first t tokens."""
        tokens = slice(int(self.offsets[seq]), int(self.offsets[seq + 1]))
        chosen = self.experts_of(tokens).to(torch.int64)  # (n, L, K)
        hits = torch.zeros(chosen.shape[0], self.num_layers, self.num_experts, dtype=torch.int64)
        hits.scatter_add_(2, chosen.clamp(min=0), (chosen >= 0).to(torch.int64))  # (n, L, E)
        return torch.cat([torch.zeros_like(hits[:1]), hits.cumsum(0)])

    def appends(
        self,
        seqs: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        row_seqs: torch.Tensor | None = None,
        with_positions: bool = False,
    ):
        """The distinct rows (a,) that tokens starts[i] .. starts[i] + counts[i] - 1 of sequence
        seqs[i] append to, numbered with seq_index row_seqs[i] (default seqs[i]); the slots each
        gains (a,) >= 1; (L,) experts chosen per layer; with_positions, also the position of each
        slot (hits.sum(),), row by row in the order of `rows`, ascending within a row (a prefix
        cache records them: which chunks each block spans)."""
        index = RowIndex(self.num_layers, self.num_experts)
        row_seqs = seqs if row_seqs is None else row_seqs
        # counted over the m sequences' own rows (m * L * E bins, not every row up to the highest
        # slot's), the sequences numbered in the order of their slots so the rows come out ascending
        order = torch.argsort(row_seqs)  # (m,)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        owner = torch.repeat_interleave(torch.arange(len(seqs)), counts)  # (N,)
        local = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[owner]
        token = self.offsets[seqs][owner] + starts[owner] + local  # (N,)
        chosen = self.experts_of(token)  # (N, L, K) int16
        # the rows of this step's sequences number fewer than 2^31: int32, half the bytes of each pass
        first_row = rank[owner].to(torch.int32)[:, None] * index.rows_per_seq  # (N, 1)
        first_row = first_row + torch.arange(self.num_layers, dtype=torch.int32) * self.num_experts  # (N, L)
        row = first_row[:, :, None] + chosen  # (N, L, K) int32
        if self.is_top_k:  # every entry is an expert: nothing to mask out
            hits = torch.bincount(row.view(-1), minlength=order.numel() * index.rows_per_seq)
            per_layer = torch.full((self.num_layers,), chosen.shape[0] * self.k_max, dtype=torch.int64)
        else:
            hits = torch.bincount(row[chosen >= 0], minlength=order.numel() * index.rows_per_seq)
            per_layer = (chosen >= 0).sum((0, 2))
        local_rows = hits.nonzero().squeeze(1)  # ascending
        rows = row_seqs[order][local_rows // index.rows_per_seq] * index.rows_per_seq
        rows += local_rows % index.rows_per_seq
        if not with_positions:
            return rows, hits[local_rows], per_layer
        position = (starts[owner] + local)[:, None, None].expand_as(row)  # (N, L, K)
        used = chosen >= 0
        by_row = torch.argsort(row[used].to(torch.int64), stable=True)  # tokens ascend within a row
        return rows, hits[local_rows], per_layer, position[used][by_row]

    def prefill_appends(self, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the prompts of `seqs` fill and the slots each gains (`appends`)."""
        count = self.prompt_lens[seqs]
        return self.appends(seqs, torch.zeros_like(count), count)[:2]

    def decode_appends(
        self,
        seqs: torch.Tensor,
        token_index: torch.Tensor,
        row_seqs: torch.Tensor | None = None,
        with_positions: bool = False,
    ):
        """The rows that token token_index[i] of sequence seqs[i] appends one slot to, numbered
        with seq_index row_seqs[i] (default seqs[i]): (a,) int64, distinct (a token's experts are
        distinct, and each sequence decodes one token); (L,) experts chosen per layer; with_positions,
        also each row's new token's position (a,) (as `appends` gives them)."""
        index = RowIndex(self.num_layers, self.num_experts)
        chosen = self.experts_of(self.offsets[seqs] + token_index).to(torch.int64)  # (m, L, K)
        row_seq = seqs if row_seqs is None else row_seqs
        rows = index.row(row_seq[:, None, None], torch.arange(self.num_layers)[None, :, None], chosen)
        if self.is_top_k:  # every entry is an expert: nothing to mask out
            rows = rows.view(-1)
            per_layer = torch.full((self.num_layers,), chosen.shape[0] * self.k_max, dtype=torch.int64)
            used = None
        else:
            used = chosen >= 0
            rows = rows[used]
            per_layer = used.sum((0, 2))
        if not with_positions:
            return rows, per_layer
        position = token_index[:, None, None].expand_as(chosen)  # (m, L, K)
        return rows, per_layer, position.reshape(-1) if used is None else position[used]


def conversation_lengths(session: torch.Tensor, prompts: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """(sessions,) tokens each session's conversation stores: every turn's new prompt and output
    tokens but the last sampled one (sim/workloads.py's sample_sessions gives the three (T,) inputs)."""
    total = torch.zeros(int(session.max()) + 1, dtype=torch.int64)
    total.index_add_(0, session, prompts + outputs)
    return total - 1


def conversation_turns(
    conversations: RoutingTrace, session: torch.Tensor, prompts: torch.Tensor, outputs: torch.Tensor
) -> tuple[RoutingTrace, torch.Tensor]:
    """The turns of multi-turn sessions as sequences of their own, and the turn each follows.

    conversations holds one sequence per session, its whole conversation (at least
    conversation_lengths tokens); turn j of a session (session, prompts, outputs: (T,) each, a
    session's turns consecutive) is that conversation's first L_j = P_j + O_j - 1 tokens, where its
    prompt P_j is every earlier turn's prompt and output tokens plus its own new prompt tokens. So a
    turn's prompt begins with the turn before it, token for token and with the same routing, and a
    prefix cache finds what that turn left. Token ids are the conversation's tokens' indices (its
    own `token_ids` if it has them): two sessions share none. Returns the turns' trace (compact:
    each token an index into the conversations' routings) and follows (T,) int64, the index of the
    turn before (-1: a session's first turn)."""
    if not (session.shape == prompts.shape == outputs.shape) or session.dim() != 1:
        raise ValueError(
            f"session, prompts and outputs must be (T,) each; got {tuple(session.shape)}, "
            f"{tuple(prompts.shape)}, {tuple(outputs.shape)}"
        )
    first = torch.ones_like(session, dtype=torch.bool)
    first[1:] = session[1:] != session[:-1]
    turns_per_session = torch.bincount(session)
    if int(first.sum()) != int((turns_per_session > 0).sum()):
        raise ValueError("each session's turns must be consecutive in session, prompts and outputs")
    if int(session.max()) >= conversations.num_sequences:
        raise ValueError(
            f"session {int(session.max())} has no conversation: the trace holds {conversations.num_sequences}"
        )
    start = torch.nonzero(first).squeeze(1)  # (sessions,) the first turn of each
    spent = (prompts + outputs).cumsum(0)  # through each turn, counted from the first session's
    before = spent - prompts - outputs
    before = before - before[start].repeat_interleave(turns_per_session[turns_per_session > 0])
    turn_prompts = before + prompts  # (T,) P_j
    turn_lengths = turn_prompts + outputs - 1  # (T,) L_j
    if bool((turn_lengths > conversations.lengths[session]).any()):
        raise ValueError("a conversation is shorter than its turns: build it with conversation_lengths")
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), turn_lengths.cumsum(0)])
    owner = torch.repeat_interleave(torch.arange(session.numel()), turn_lengths)  # (N,)
    position = torch.arange(int(offsets[-1])) - offsets[:-1][owner]
    index = conversations.offsets[session][owner] + position  # (N,) into the conversations' tokens
    bank = conversations.token_routing
    token_ids = index if conversations.token_ids is None else conversations.token_ids[index]
    trace = RoutingTrace(
        conversations.routings,
        offsets,
        turn_prompts,
        conversations.num_experts,
        conversations.kv_bytes_per_slot,
        f"{conversations.name}-turns",
        index if bank is None else bank[index],
        token_ids,
    )
    follows = torch.where(first, -1, torch.arange(session.numel()) - 1)
    return trace, follows


def _check_sizes(skews: dict, **sizes) -> None:
    for name, value in sizes.items():
        check_int(name, value, 1, MAX_INT32)
    if sizes["top_k"] > sizes["num_experts"]:
        raise ValueError(f"top_k={sizes['top_k']} is greater than num_experts={sizes['num_experts']}")
    for name, value in skews.items():
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")


def _lengths(num_sequences: int, mean_prompt, mean_output, sigma, generator, lengths=None):
    """Log-normal prompt and output lengths >= 1 of the given means (mu = ln(mean) - sigma^2 / 2),
    or the given (prompts, outputs) (S,) each (workloads.sample_lengths): prompts (S,), and the
    offsets (S + 1,) of the whole sequences."""
    if lengths is not None:
        prompts, outputs = (torch.as_tensor(x, dtype=torch.int64) for x in lengths)
        if (
            prompts.shape != (num_sequences,)
            or outputs.shape != (num_sequences,)
            or bool((prompts < 1).any())
            or bool((outputs < 1).any())
        ):
            raise ValueError(
                f"lengths must be (prompts, outputs) of shape ({num_sequences},) each, every "
                f"length >= 1; got shapes {tuple(prompts.shape)} and {tuple(outputs.shape)}"
            )
    else:
        mus = [torch.log(torch.tensor(mean)) - sigma**2 / 2 for mean in (mean_prompt, mean_output)]
        prompts, outputs = (
            torch.exp(mu + sigma * torch.randn(num_sequences, generator=generator))
            .round()
            .clamp(min=1)
            .to(torch.int64)
            for mu in mus
        )
    return prompts, torch.cat([torch.zeros(1, dtype=torch.int64), (prompts + outputs).cumsum(0)])


def _gumbel_top_k(log_weight, num_tokens: int, top_k: int, generator, token_topic=None):
    """(num_tokens, L, K) int16: k distinct experts per token and layer, by Gumbel top-k (sampling
    without replacement) on log_weight (L, E), or on log_weight[token_topic[t]] of a (T, L, E)."""
    L, E = log_weight.shape[-2:]
    experts = torch.empty(num_tokens, L, top_k, dtype=torch.int16)
    chunk = 8192  # bounds the (chunk, L, E) noise tensor
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        uniform = torch.rand(n, L, E, generator=generator).clamp_(1e-12, 1.0)
        gumbel = -torch.log(-torch.log(uniform))  # (n, L, E)
        weight = log_weight if token_topic is None else log_weight[token_topic[start : start + n]]
        experts[start : start + n] = (weight + gumbel).topk(top_k, dim=-1).indices.to(torch.int16)
    return experts


def _bank(log_weight, bank_size: int, top_k: int, generator, offsets, topic=None):
    """A compact trace's routings: bank_size Gumbel top-k draws per topic, topic t's being rows
    t * B .. (t + 1) * B - 1 of (T * B, L, K) int16, and for every token one of its topic's draws,
    uniformly at random: (num_tokens,) int32. log_weight (L, E) with topic None (one topic), or
    (T, L, E) with topic (S,) of each sequence; offsets (S + 1,)."""
    num_topics = 1 if topic is None else log_weight.shape[0]
    bank_topic = None if topic is None else torch.arange(num_topics).repeat_interleave(bank_size)  # (T * B,)
    routings = _gumbel_top_k(log_weight, num_topics * bank_size, top_k, generator, bank_topic)
    num_tokens = int(offsets[-1])
    token_routing = torch.randint(bank_size, (num_tokens,), generator=generator, dtype=torch.int32)
    if topic is not None:
        token_routing += torch.repeat_interleave((topic * bank_size).to(torch.int32), offsets.diff())
    return routings, token_routing


def _check_bank_size(distinct_routings, num_topics: int = 1) -> int | None:
    return check_int(
        "distinct_routings",
        distinct_routings,
        1,
        MAX_INT32 // num_topics,
        meaning="routings drawn per topic, the bank of a compact trace; None: every token draws its own",
        allow_none=True,
    )


def _log_rank(n: int, num_layers: int, num_experts: int, generator) -> torch.Tensor:
    """(n, L, E) float32: log(1 + rank) of each expert in a random ranking per layer, n times."""
    ranks = torch.stack(
        [
            torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(num_layers)])
            for _ in range(n)
        ]
    )
    return torch.log1p(ranks.to(torch.float32))


def synthetic_trace(
    num_sequences: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    mean_prompt: float = 256,
    mean_output: float = 256,
    sigma: float = 0.5,
    zipf_s: float = 1.0,
    kv_bytes_per_slot: int = 512,
    seed: int = 0,
    name: str = "synthetic",
    lengths=None,
    distinct_routings: int | None = None,
) -> RoutingTrace:
    """Top-k routing, Zipf(s) expert popularity, log-normal prompt and output lengths: each layer
    ranks its experts at random (the hot expert differs per layer), rank r weighs 1 / r^s, and a
    token takes k distinct experts by those weights (Gumbel top-k). zipf_s = 0 is uniform. lengths:
    (prompts, outputs) to use instead of the log-normal ones (also in topic_trace).

    distinct_routings (also in topic_trace): None draws every token's routing (bit-identical to the
    traces before this option existed). B draws only B routings per topic and gives each token one of
    its topic's B uniformly at random, in a compact RoutingTrace (token_routing). Tokens stay
    independent draws, but from the bank's empirical distribution, B samples of the true one: a
    (layer, expert) frequency moves by about sqrt(p (1 - p) / B), and no more than B routings
    (duplicates possible) occur per topic. The price buys memory and time: at 10^5 requests of 768
    tokens, 24 layers and top-8, per-token routing is 29 GB of int16 and most of an hour of Gumbel
    noise; B = 32768 is a 12 MiB bank plus 4 bytes a token (0.3 GB), built in seconds."""
    _check_sizes(
        dict(zipf_s=zipf_s),
        num_sequences=num_sequences,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
    )
    bank_size = _check_bank_size(distinct_routings)
    generator = torch.Generator().manual_seed(seed)
    prompts, offsets = _lengths(num_sequences, mean_prompt, mean_output, sigma, generator, lengths)
    log_weight = -zipf_s * _log_rank(1, num_layers, num_experts, generator)[0]  # (L, E)
    if bank_size is not None:
        routings, token_routing = _bank(log_weight, bank_size, top_k, generator, offsets)
        return RoutingTrace(routings, offsets, prompts, num_experts, kv_bytes_per_slot, name, token_routing)
    experts = _gumbel_top_k(log_weight, int(offsets[-1]), top_k, generator)
    return RoutingTrace(experts, offsets, prompts, num_experts, kv_bytes_per_slot, name)


def topic_trace(
    num_sequences: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    num_topics: int = 4,
    topic_s: float = 1.5,
    global_s: float = 0.5,
    topic_popularity_s: float = 1.0,
    mean_prompt: float = 256,
    mean_output: float = 256,
    sigma: float = 0.5,
    kv_bytes_per_slot: int = 512,
    seed: int = 0,
    name: str = "topics",
    lengths=None,
    distinct_routings: int | None = None,
) -> tuple[RoutingTrace, torch.Tensor]:
    """A RoutingTrace and the topic of each sequence, (S,) int64. Learned routers specialise
    (`routing-stats`): sequences lean on their topic's experts, so under per-device pools the
    victim matters (notebooks 05 and 11). A token of topic t takes k distinct experts by Gumbel top-k on

        log w[l, e] = -global_s * log(1 + global_rank[l, e]) - topic_s * log(1 + topic_rank[t, l, e])

    with Zipf(topic_popularity_s) topic popularity, so the most popular topic's experts (and, under
    a co-activation placement, the device they share) fill first."""
    _check_sizes(
        dict(topic_s=topic_s, global_s=global_s, topic_popularity_s=topic_popularity_s),
        num_sequences=num_sequences,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        num_topics=num_topics,
    )
    bank_size = _check_bank_size(distinct_routings, num_topics)
    generator = torch.Generator().manual_seed(seed)
    prompts, offsets = _lengths(num_sequences, mean_prompt, mean_output, sigma, generator, lengths)
    global_weight = -global_s * _log_rank(1, num_layers, num_experts, generator)[0]  # (L, E)
    topic_weight = -topic_s * _log_rank(num_topics, num_layers, num_experts, generator)  # (T, L, E)
    popularity = torch.arange(1, num_topics + 1, dtype=torch.float64) ** -topic_popularity_s
    topic = torch.multinomial(popularity, num_sequences, replacement=True, generator=generator)  # (S,)
    if bank_size is not None:
        log_weight = global_weight + topic_weight  # (T, L, E)
        routings, token_routing = _bank(log_weight, bank_size, top_k, generator, offsets, topic)
        trace = RoutingTrace(routings, offsets, prompts, num_experts, kv_bytes_per_slot, name, token_routing)
        return trace, topic
    token_topic = torch.repeat_interleave(topic, offsets[1:] - offsets[:-1])  # (N,)
    experts = _gumbel_top_k(global_weight + topic_weight, int(offsets[-1]), top_k, generator, token_topic)
    return RoutingTrace(experts, offsets, prompts, num_experts, kv_bytes_per_slot, name), topic
