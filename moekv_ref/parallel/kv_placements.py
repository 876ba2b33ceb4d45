"""Where the attention experts' K/V live under expert parallelism: three placements, one interface,
`forward(layer, h, seq_ids, positions, traffic) -> (N, D)`, the attention output of the home rank's
N tokens, counting what it sends in `traffic`. Every rank calls it for every layer of every step.

kv_with_expert
    Expert e's weights and K/V (of every sequence) live on e's rank. A token's hidden state goes
    once to each of its experts' ranks, which attend and send gate * W_o(attention) back: tokens x
    ranks x D travel, whatever the context. Each pool holds a share of every sequence, as the router
    loads its experts (skew fills one first).

kv_with_sequence
    A sequence's K/V stays on its home rank; expert weights stay sharded. The cached K/V goes to the
    expert's rank, which runs the whole expert, and the new k, v come back home (moving the query
    instead would need three exchanges per layer and run every expert's attention at home). Each
    step re-sends every row's whole context: the bottleneck this placement exists to show.

replicated_attention
    Every rank holds every attention expert and its sequences' caches; attention runs at home
    (data-parallel attention, as SGLang and vLLM serve DeepSeek's MLA). No attention bytes travel;
    the price is every attention weight on every rank.

FFN experts are expert-parallel in all three (runner.py). Pool rows use global expert ids.

Dimension legend: N home tokens, n tokens received, M (token, expert) pairs run here, D width,
H heads, Hkv key/value heads, Dh head width, E experts, Q context rows sent, T context tokens sent.
"""

from __future__ import annotations

from collections import Counter

import torch
from einops import rearrange

from ..cache import ContiguousKVCache, PagedKVCache
from ..model import grouped_matmul, project_qkv, rotary_turns
from .comm import Communicator
from .dispatch import DispatchPlan, combine, dispatch, local_pairs
from .shard import RankShard

KV_PLACEMENTS = ("kv_with_expert", "kv_with_sequence", "replicated_attention")


class _PlacedAttention:
    """What every placement holds; attention_ranks (L, E): the rank of every attention expert."""

    def __init__(
        self, shard: RankShard, comm: Communicator, cache: PagedKVCache, attention_ranks: torch.Tensor
    ):
        self.shard, self.comm, self.cache, self.attention_ranks = shard, comm, cache, attention_ranks

    def _dispatch(self, layer: int, h, seq_ids, positions, traffic: Counter):
        """Route the home tokens and send them to their experts' ranks: (plan, received)."""
        routing = self.shard.route_attention(layer, h)  # (N, E)
        plan = DispatchPlan.build(
            routing.selected,
            routing.gates,
            self.attention_ranks[layer],
            self.comm.world_size,
            self.shard.config.num_attention_experts_per_tok,
        )
        traffic["attention_pairs_to_peers"] += plan.pairs_to_peers(self.comm.rank)
        traffic["attention_expert_pairs_to_peers"] += plan.expert_pairs_to_peers(self.comm.rank)
        return plan, dispatch(self.comm, plan, h, "attention_dispatch", seq_ids, positions)

    def _experts(self, layer: int, h, plan: DispatchPlan, received, cache):
        """The received tokens through this rank's attention experts, their K/V in `cache`, combined
        back home: (N, D), and the pairs run here with their new k, v."""
        config, part, backend = self.shard.config, self.shard.layers[layer], self.shard.backend
        pairs = local_pairs(received, part.attention_experts)
        xs, ps = received.hidden[pairs.token], received.positions[pairs.token].to(h.device)  # (M, D), (M,)
        turns = rotary_turns(ps, config.head_dim, config.rope_theta, xs.dtype)  # (M, 1, Dh/2)
        q, k, v = project_qkv(
            config, xs, turns, pairs.counts, torch.cat([part.w_q, part.w_k, part.w_v], 2), backend
        )
        appended = cache.append_kv(layer, received.seq_ids[pairs.token], pairs.expert, ps, k, v)
        attention = rearrange(cache.attend(appended, q), "m h d -> m (h d)")  # (M, H * Dh)
        y = grouped_matmul(attention, part.w_o, pairs.counts, backend)
        out = combine(self.comm, plan, received, pairs, y, h.shape[0], "attention_combine")
        return out, pairs, k, v


class KVWithExpert(_PlacedAttention):
    def forward(self, layer: int, h, seq_ids, positions, traffic: Counter) -> torch.Tensor:
        plan, received = self._dispatch(layer, h, seq_ids, positions, traffic)
        return self._experts(layer, h, plan, received, self.cache)[0]


class KVWithSequence(_PlacedAttention):
    def forward(self, layer: int, h, seq_ids, positions, traffic: Counter) -> torch.Tensor:
        config, comm, R = self.shard.config, self.comm, self.comm.world_size
        Hkv, Dh = config.num_key_value_heads, config.head_dim
        plan, received = self._dispatch(layer, h, seq_ids, positions, traffic)

        # home side: each destination gets the cached K/V of every (sequence, expert) row it serves
        pair, slot = (plan.experts >= 0).nonzero(as_tuple=True)  # row-major
        row_rank = plan.rank[pair]
        row_seq, row_expert = seq_ids.cpu()[plan.token[pair]], plan.experts[pair, slot]
        first = _first_of_each(torch.stack([row_rank, row_seq, row_expert], 1))  # distinct rows
        q_rank, q_seq, q_expert = row_rank[first], row_seq[first], row_expert[first]  # (Q,) by rank
        counts, slots = self._cached_rows(layer, q_seq, q_expert)  # (Q,), (T,)
        slots = slots.to(self.cache.key_cache.device)
        kv_flat = torch.stack(
            [self.cache.key_cache.view(-1, Hkv, Dh)[slots], self.cache.value_cache.view(-1, Hkv, Dh)[slots]],
            dim=1,
        ).to(h.dtype)  # (T, 2, Hkv, Dh)
        rows_per_rank = torch.bincount(q_rank, minlength=R).tolist()
        tokens_per_rank = torch.zeros(R, dtype=torch.int64).index_add_(0, q_rank, counts).tolist()
        remote = q_rank != comm.rank
        traffic["kv_rows_to_peers"] += int(remote.sum())
        traffic["kv_tokens_to_peers"] += int(counts[remote].sum())
        meta = torch.stack([q_seq, q_expert, counts], dim=1)  # (Q, 3)
        meta_in, rows_in = comm.all_to_all(meta.to(comm.device), rows_per_rank, "kv_context")
        meta_in = meta_in.cpu()
        kv_in = comm.all_to_all(
            kv_flat.to(comm.device), tokens_per_rank, "kv_context", _sum_per_source(rows_in, meta_in[:, 2])
        )[0].to(h.device)

        # expert side: the rows' cached K/V, then this step's tokens, in a cache that lives for one
        # call. The cached tokens get stand-in positions 0..count-1: only their order matters (all
        # are earlier than every new token, and count <= the first new token's position).
        visiting = ContiguousKVCache(config.num_hidden_layers, config.num_attention_experts)
        if kv_in.shape[0]:
            row_of_token = torch.repeat_interleave(torch.arange(meta_in.shape[0]), meta_in[:, 2])  # (T,)
            index_in_row = (
                torch.arange(kv_in.shape[0]) - (torch.cumsum(meta_in[:, 2], 0) - meta_in[:, 2])[row_of_token]
            )
            visiting.append_kv(
                layer,
                meta_in[row_of_token, 0],
                meta_in[row_of_token, 1],
                index_in_row.to(h.device),
                kv_in[:, 0],
                kv_in[:, 1],
            )
        out, pairs, k, v = self._experts(layer, h, plan, received, visiting)

        # the new tokens' k, v go home, in the order the home listed the pairs (row-major slots)
        new_kv = torch.empty(pairs.order.numel(), 2, Hkv, Dh, dtype=k.dtype, device=k.device)
        new_kv[pairs.order] = torch.stack([k, v], dim=1)  # (M, 2, Hkv, Dh)
        send_back = _sum_per_source(received.recv_counts, (received.experts >= 0).sum(1))
        expect = torch.bincount(row_rank, minlength=R).tolist()
        kv_home = comm.all_to_all(new_kv.to(comm.device), send_back, "kv_new", expect)[0].to(h.device)
        traffic["kv_new_pairs_to_peers"] += int((row_rank != comm.rank).sum())
        self.cache.append_kv(
            layer, row_seq, row_expert, positions.cpu()[plan.token[pair]], kv_home[:, 0], kv_home[:, 1]
        )
        return out

    def _cached_rows(self, layer: int, seq_ids: torch.Tensor, experts: torch.Tensor):
        """Tokens each (sequence, layer, expert) row holds in the home pool (0 for a sequence the pool
        has not seen), and the slots of all of them, row after row: (Q,), (T,)."""
        manager = self.cache.manager
        known = torch.tensor([manager.holds(s) for s in seq_ids.tolist()], dtype=torch.bool)
        rows = manager.rows(seq_ids[known], layer, experts[known])
        counts = torch.zeros(seq_ids.numel(), dtype=torch.int64)
        counts[known] = manager.row_tokens[rows]
        return counts, manager.rows_slots(rows)


class ReplicatedAttention(_PlacedAttention):
    def forward(self, layer: int, h, seq_ids, positions, traffic: Counter) -> torch.Tensor:
        return self.shard.layers[layer].attention.forward_cached(h, seq_ids, positions, self.cache)[0]


PLACEMENT_CLASSES = dict(zip(KV_PLACEMENTS, (KVWithExpert, KVWithSequence, ReplicatedAttention)))


def _sum_per_source(counts: list[int], values: torch.Tensor) -> list[int]:
    """values (n,) of rows received counts[r] from each rank r in turn: their sum per rank."""
    source = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.zeros(len(counts), dtype=torch.int64).index_add_(0, source, values).tolist()


def _first_of_each(key: torch.Tensor) -> torch.Tensor:
    """The index of the first occurrence of each distinct row of key (n, k), in occurrence order."""
    unique, inverse = torch.unique(key, return_inverse=True, dim=0)
    n = key.shape[0]
    first = torch.full((unique.shape[0],), n, dtype=torch.int64)
    return first.scatter_reduce(0, inverse, torch.arange(n), reduce="amin").sort().values
