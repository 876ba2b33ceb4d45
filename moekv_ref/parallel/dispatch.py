"""Dispatch and combine: a token's hidden state goes once to each rank holding one of its experts.

A `DispatchPlan` lists a home rank's (token, destination rank) pairs: one per distinct rank among
the token's experts, not one per expert (as DeepEP lays tokens out per rank; the DeepSeek-V3
technical report, arXiv 2412.19437, section 3.2.2, sends a token once to each node it needs).

Wire format of one (token, rank) pair, which the cost model reproduces byte for byte:

    floats  (D + K,)      the hidden state, then the gates of the token's experts on that rank
                          (padded with 0 to K slots), model dtype
    ints    (K,)          those experts' ids, padded with -1; attention adds the token's sequence id
            (2 + K,)      and position in front: [seq_id, position, e1, e2, ...]
    back    (D,)          the destination's sum of gate * expert output (combine), model dtype

K is the layer's most experts per token (k, or k_max under threshold routing). Rows are grouped by
destination rank, tokens in home order within a rank, as `all_to_all_single` with split sizes wants.

Dimension legend: N tokens on the home rank, E experts of the layer, R ranks, P (token, rank) pairs,
K expert slots per pair, D model width, n tokens a rank received, M (token, expert) pairs run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import Communicator


@dataclass
class DispatchPlan:
    """Where a home rank's tokens go for one layer's experts, pairs grouped by rank."""

    token: torch.Tensor  # (P,) int64, the token of each (token, rank) pair
    rank: torch.Tensor  # (P,) int64, the destination rank
    experts: torch.Tensor  # (P, K) int64, its experts on that rank, ascending, -1 padded
    gates: torch.Tensor  # (P, K), their gates, 0 padded
    send_counts: list[int]  # R, pairs per destination rank

    @classmethod
    def build(
        cls,
        selected: torch.Tensor,
        gates: torch.Tensor,
        rank_of_expert: torch.Tensor,
        world_size: int,
        slots: int,
    ) -> "DispatchPlan":
        """selected (N, E) bool, gates (N, E) from a Routing; rank_of_expert (E,); slots = K. The plan
        is integers on the CPU, wherever the model runs."""
        selected, gates = selected.cpu(), gates.cpu()
        N, E = selected.shape
        rank_of_expert = torch.as_tensor(rank_of_expert, dtype=torch.int64)
        on_rank = selected[:, None, :] & (
            rank_of_expert[None, None, :] == torch.arange(world_size)[None, :, None]
        )  # (N, R, E)
        rank, token = on_rank.any(-1).T.nonzero(as_tuple=True)  # (P,) grouped by rank
        mine = on_rank[token, rank]  # (P, E)
        # the pair's experts in ascending order: chosen experts keep their id, the others sort last
        ids = torch.where(mine, torch.arange(E), E).sort(dim=1).values[:, :slots]  # (P, K)
        if mine.numel() and int(mine.sum(1).max()) > slots:
            raise ValueError(f"a token has more than slots={slots} experts on one rank")
        valid = ids < E
        experts = torch.where(valid, ids, -1)
        pair_gates = torch.where(valid, gates[token[:, None], ids.clamp(max=E - 1)], 0.0)  # (P, K)
        send_counts = torch.bincount(rank, minlength=world_size).tolist()
        return cls(token, rank, experts, pair_gates.to(gates.dtype), send_counts)

    def pairs_to_peers(self, home_rank: int | torch.Tensor) -> int:
        """(token, rank) pairs whose rank is not home_rank (or each pair's (P,)): hidden states sent."""
        return int((self.rank != home_rank).sum())

    def expert_pairs_to_peers(self, home_rank: int | torch.Tensor) -> int:
        """(token, expert) pairs on other ranks: what a once-per-expert dispatch would send."""
        return int(((self.experts >= 0) & (self.rank != home_rank)[:, None]).sum())


@dataclass
class Received:
    """The pairs a rank received for its experts, grouped by source rank."""

    hidden: torch.Tensor  # (n, D) on the model's device
    gates: torch.Tensor  # (n, K) on the model's device
    experts: torch.Tensor  # (n, K) on the CPU, as the rest
    seq_ids: torch.Tensor | None  # (n,), attention only
    positions: torch.Tensor | None  # (n,), attention only
    recv_counts: list[int]  # R


def dispatch(
    comm: Communicator,
    plan: DispatchPlan,
    hidden: torch.Tensor,
    category: str,
    seq_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> Received:
    """Send each pair's hidden state, gates and expert ids (and, for attention, its sequence id and
    position) to its rank: split sizes, then one all-to-all of floats and one of ints."""
    floats = torch.cat(
        [hidden[plan.token.to(hidden.device)], plan.gates.to(hidden.device, hidden.dtype)], dim=1
    )  # (P, D + K)
    ints = plan.experts
    if seq_ids is not None:
        seq_ids, positions = seq_ids.cpu(), positions.cpu()
        ints = torch.cat([seq_ids[plan.token, None], positions[plan.token, None], ints], dim=1)  # (P, 2 + K)
    floats_in, recv_counts = comm.all_to_all(floats.to(comm.device), plan.send_counts, category)
    ints_in, _ = comm.all_to_all(ints.to(comm.device), plan.send_counts, category, recv_counts)
    floats_in, ints_in = (
        floats_in.to(hidden.device),
        ints_in.cpu(),
    )  # math on the model's device, ids on the CPU
    D = hidden.shape[1]
    hidden_in, gates_in = floats_in[:, :D], floats_in[:, D:]  # (n, D), (n, K)
    if seq_ids is None:
        return Received(hidden_in, gates_in, ints_in, None, None, recv_counts)
    return Received(hidden_in, gates_in, ints_in[:, 2:], ints_in[:, 0], ints_in[:, 1], recv_counts)


def combine(
    comm: Communicator,
    plan: DispatchPlan,
    received: Received,
    pairs: "LocalPairs",
    y: torch.Tensor,
    num_tokens: int,
    category: str,
) -> torch.Tensor:
    """Sum gate * y (M, D) per received token, send the sums back home (split sizes known from the
    dispatch) and add them up per home token: (num_tokens, D)."""
    hidden = received.hidden
    partial = hidden.new_zeros(hidden.shape).index_add_(
        0, pairs.token.to(hidden.device), pairs.gate[:, None] * y
    )  # (n, D)
    back, _ = comm.all_to_all(partial.to(comm.device), received.recv_counts, category, plan.send_counts)
    out = partial.new_zeros(num_tokens, partial.shape[1])
    return out.index_add_(0, plan.token.to(out.device), back.to(out.device))  # (N, D)


@dataclass
class LocalPairs:
    """The (received token, local expert) pairs a rank runs, sorted by local expert."""

    token: torch.Tensor  # (M,) into the received rows
    expert: torch.Tensor  # (M,) global ids
    gate: torch.Tensor  # (M,)
    counts: torch.Tensor  # (E_local,) pairs per local expert
    order: torch.Tensor  # (M,) each pair's index among the received (n, K) slots read row-major


def local_pairs(received: Received, local_experts: torch.Tensor) -> LocalPairs:
    """Expand each received token into its experts here, sorted by local expert (tokens keep their
    received order within an expert, so a sequence's tokens reach a cache row in position order)."""
    # global id -> index among this rank's experts, -1 for the others; a rank may hold none of the
    # layer's experts (it then receives no pairs and computes nothing), so either side may be empty
    ids = torch.cat([local_experts.cpu(), received.experts.flatten(), torch.zeros(1, dtype=torch.int64)])
    local_of = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
    local_of[local_experts] = torch.arange(local_experts.numel())
    token, slot = (received.experts >= 0).nonzero(as_tuple=True)  # (M,) row-major
    expert = received.experts[token, slot]
    local = local_of[expert]
    if (local < 0).any():
        raise RuntimeError(
            f"received experts {expert[local < 0].unique().tolist()} that this rank "
            f"does not hold (its experts: {local_experts.tolist()})"
        )
    order = torch.argsort(local, stable=True)  # (M,) sorted by expert
    counts = torch.bincount(local, minlength=local_experts.numel())
    return LocalPairs(token[order], expert[order], received.gates[token[order], slot[order]], counts, order)
