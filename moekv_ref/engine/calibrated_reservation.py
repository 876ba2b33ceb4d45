"""CalibratedReservation: a ReservationPolicy (reservation.py) between WorstCaseReservation, which
sets aside the most a step's tokens could take, and OptimisticReservation, which sets aside what
they are expected to take and throws a whole forward away when a layer runs short.

    decode token     its worst case: one block for each open row it may enter (demand.py's bound
                     for n = 1), which is exact and cheap, so a decode never runs short
    prefill chunk    on each device d, a quantile of the blocks the chunk will open there:
                     mu_d + z_q * sigma_d + headroom_d, capped by its worst case
    chunk size       at most `max_chunk_tokens` tokens a step (vLLM caps long prefills the same
                     way), so that no one chunk's uncertainty dominates a step
    a short layer    the step is not undone: the chunk scheduled last leaves it, preempted by
                     recompute, and the forward goes on for the others (Scheduler.repair)

mu and sigma come from the request's own routing so far, with a prior learned from the requests
before it. A request's tokens send a share of their entries (token, layer, expert) to each device
d; across requests the shares have a mean m_d and a variance v_d, measured once per request after
its first chunk (before `min_observed` requests are measured, a chunk reserves its worst case). The
prior is worth c0 tokens, c0 = m (1 - m) / v - 1 (a Beta distribution's concentration), against
the c tokens the request has computed:

    each row (l, e):  a token's expected entries  r = (c0 * k_l m_d / E_d + count) / (c0 + c)
                      (the prior's share of its device spread over the device's experts of that
                      layer, against the row's own count), so the chunk's n tokens put X, about
                      Poisson(n r), into it; a row with f free slots in its last block opens its
                      j-th block when X >= f + (j - 1) P + 1, so its blocks' mean and variance are
                      sums of Poisson tails (`row_blocks`)
    each device d:    mu_d is the sum over its rows; sigma_d^2 their variances' sum (the rows
                      taken apart) plus N^2 v_post / P^2, the spread of the request's share of the
                      device (topics make its rows rise and fall together): N = n x the experts a
                      token takes over all layers, v_post = v_d c0 / (c0 + c)

Measured against what the trace then took (tests/spec/test_calibrated_reservation.py, 96 requests
of a skewed topic trace on 4 devices, three seeds): a chunk exceeds its q = 0.9 quantile on 3.1% of
(chunk, device) pairs and its q = 0.99 quantile on 0.13%, reserving 1.26x and 1.45x what it takes
(the Poisson's spread is a binomial's or more: conservative); on bench cluster's 8 GPUs, 7.2% and
0.91%, at 1.17x and 1.31x (300 requests, 0.5 GiB a GPU).

The headroom per device rises by the blocks a layer lacked each time one runs short (`note_fault`)
and decays by `headroom_decay` a step: after a fault the next chunks reserve more, for a while.
"""

from __future__ import annotations

from statistics import NormalDist

import torch

from ..validation import MAX_INT32, check_int, check_real
from .reservation import ReservationPolicy


class CalibratedReservation(ReservationPolicy):
    """Reserve a decode token's worst case and a prefill chunk's q-quantile per device; drop the
    last chunk when a layer runs short (module docstring)."""

    name = "calibrated"
    repairs = True
    STATE = ("headroom", "share_sum", "share_sq_sum", "num_observed", "observed")

    def __init__(
        self,
        q: float = 0.99,
        max_chunk_tokens: int = 1024,
        headroom_decay: float = 0.95,
        min_observed: int = 8,
    ):
        """q: the quantile each chunk reserves on each device, in (0, 1); max_chunk_tokens: the
        most tokens of one request a step runs; headroom_decay: what a step keeps of the headroom,
        in [0, 1); min_observed: requests measured before the prior replaces the worst case."""
        self.q = check_real("q", q, 0.0, 1.0, low_open=True, high_open=True, meaning="a quantile")
        self.max_chunk_tokens = check_int("max_chunk_tokens", max_chunk_tokens, 1, MAX_INT32)
        self.headroom_decay = check_real(
            "headroom_decay", headroom_decay, 0.0, 1.0, high_open=True, meaning="kept per step"
        )
        self.min_observed = check_int("min_observed", min_observed, 1, MAX_INT32)
        self.z = NormalDist().inv_cdf(self.q)
        self.headroom = None  # (D,) float64 blocks, made on first use
        self.share_sum = None  # (D,) float64: the measured requests' shares, summed
        self.share_sq_sum = None  # (D,) float64: and their squares
        self.num_observed = 0
        self.observed: set[int] = set()  # ids of the requests in flight that were measured

    def chunk_tokens(self, request, token_budget: int) -> int:
        return min(request.num_pending_tokens, token_budget, self.max_chunk_tokens)

    def start_step(self) -> None:
        if self.headroom is not None:
            self.headroom = self.headroom * self.headroom_decay

    def note_fault(self, shortfall: torch.Tensor) -> None:
        shortfall = shortfall.to(torch.float64)
        self.headroom = shortfall.clone() if self.headroom is None else self.headroom + shortfall

    def step_needs(self, requests, num_tokens, worst_case, memory, predictor) -> torch.Tensor:
        self._observe([r for r in requests if r.num_computed_tokens > 0], memory)
        chunks = [
            i for i, (r, n) in enumerate(zip(requests, num_tokens)) if n > 1 or r.num_computed_tokens == 0
        ]
        needs = torch.zeros(len(requests), memory.num_devices, dtype=torch.int64)
        chunk_set = set(chunks)
        decodes = [i for i in range(len(requests)) if i not in chunk_set]
        if decodes:
            needs[decodes] = worst_case([requests[i] for i in decodes], [num_tokens[i] for i in decodes])
        if not chunks:
            return needs
        chosen = [requests[i] for i in chunks]
        tokens = [num_tokens[i] for i in chunks]
        worst = worst_case(chosen, tokens)  # (c, D)
        if self.num_observed < self.min_observed:
            needs[chunks] = worst  # no prior yet: the safe one
            return needs
        needs[chunks] = torch.minimum(self.quantile_blocks(chosen, tokens, memory, predictor), worst)
        return needs

    def quantile_blocks(self, requests, num_tokens, memory, predictor) -> torch.Tensor:
        """(m, D) mu + z sigma + headroom of the blocks each chunk opens on each device, rounded up
        (module docstring)."""
        P = memory.block_size
        D = memory.num_devices
        counts, devices = self._rows(requests, memory)  # (m, L, E) each
        m = counts.shape[0]
        done = torch.tensor([float(r.num_computed_tokens) for r in requests], dtype=torch.float64)
        c = done.view(m, 1, 1)
        n = torch.tensor(num_tokens, dtype=torch.float64).view(m, 1, 1)
        k = predictor.k_avg.view(1, -1, 1)  # (1, L, 1) experts a token takes at each layer
        mean, var = self.prior()  # (D,) each
        c0 = torch.clamp(mean * (1 - mean) / var - 1, min=1.0, max=1e6)  # (D,) the prior's worth in tokens
        # a token's expected entries in each row: the prior's share of its device spread evenly over
        # the device's experts of that layer, weighed against the request's own so far
        experts_there = _by_device(torch.ones_like(counts), devices, D, per_layer=True)  # (m, L, D)
        prior_rate = k * mean[devices] / experts_there.gather(2, devices)  # (m, L, E)
        rate = (c0[devices] * prior_rate + counts) / (c0[devices] + c)
        blocks_mean, blocks_var = row_blocks(counts, n * rate, n, P)  # (m, L, E) each
        # the request's share of each device is itself uncertain (topics: its rows rise and fall
        # together), which the rows' own spread leaves out: N^2 v_post entries^2, over P^2
        var_post = var * c0 / (c0 + done.view(m, 1))  # (m, D)
        N = n.view(m, 1) * float(predictor.k_avg.sum())
        between = (N**2 * var_post) / P**2
        mu = _by_device(blocks_mean, devices, D)  # (m, D)
        sd = torch.sqrt(_by_device(blocks_var, devices, D) + between)
        headroom = torch.zeros(D, dtype=torch.float64) if self.headroom is None else self.headroom
        return torch.ceil((mu + self.z * sd + headroom).clamp(min=0) - 1e-9).to(torch.int64)

    def prior(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(D,) mean and sample variance of the measured requests' shares (a floor keeps a device
        no request has used yet from reading as certain)."""
        k = self.num_observed
        mean = self.share_sum / k
        var = (self.share_sq_sum - k * mean**2) / max(k - 1, 1)
        return mean, torch.clamp(var, min=1e-6)

    def _observe(self, requests, memory) -> None:
        """Each request's share per device, once, after its first chunk (the prior's data)."""
        new = [r for r in requests if r.request_id not in self.observed]
        if not new:
            return
        counts, devices = self._rows(new, memory)
        entries_on = _by_device(counts, devices, memory.num_devices).double()  # (m, D)
        total = entries_on.sum(1, keepdim=True)
        kept = total[:, 0] > 0  # a request holding nothing (swapped out) is measured later
        shares = entries_on[kept] / total[kept]
        if self.share_sum is None:
            self.share_sum = torch.zeros(memory.num_devices, dtype=torch.float64)
            self.share_sq_sum = torch.zeros(memory.num_devices, dtype=torch.float64)
        self.share_sum = self.share_sum + shares.sum(0)
        self.share_sq_sum = self.share_sq_sum + (shares**2).sum(0)
        self.num_observed += int(kept.sum())
        self.observed = self.observed | {r.request_id for r, k in zip(new, kept.tolist()) if k}

    def release(self, request) -> None:
        # a finished request never comes back: its id goes (its share stays in the prior's sums)
        self.observed = self.observed - {request.request_id}

    @staticmethod
    def _rows(requests, memory) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [r.request_id for r in requests]
        return memory.token_counts(ids), memory.placement.of_sequences(ids)

    def __repr__(self) -> str:
        return (
            f"CalibratedReservation(q={self.q}, max_chunk_tokens={self.max_chunk_tokens}, "
            f"headroom_decay={self.headroom_decay}, min_observed={self.min_observed})"
        )


def row_blocks(held: torch.Tensor, expected: torch.Tensor, n: torch.Tensor, P: int) -> tuple:
    """held (m, L, E) tokens in each row, expected (m, L, E) new tokens it is expected to get, n
    (m, 1, 1) the chunk's tokens -> the mean and variance of the blocks each row opens, its new
    tokens X taken as Poisson (at least the binomial's spread). A row with r free slots in its
    last block opens its j-th block when X >= r + (j - 1) P + 1, so

        E[blocks] = sum_j P(X >= t_j),   E[blocks^2] = sum_j (2j - 1) P(X >= t_j)

    with P(X >= t) = gammainc(t, lambda), the regularized lower incomplete gamma function."""
    room = (-held) % P  # (m, L, E) free slots in the last block (0: empty or full)
    # X <= n opens at most n / P + 1 blocks; past lambda + 12 sqrt(lambda) + 12 the tail is below
    # 1e-12 (a Poisson's), so the sum stops there
    top = float(expected.max()) if expected.numel() else 0.0
    reach = min(int(n.max()), int(top + 12 * top**0.5 + 12))
    j = torch.arange(1, reach // P + 3, dtype=torch.float64)  # (J,)
    t = room.unsqueeze(-1).double() + (j - 1) * P + 1  # (m, L, E, J)
    tail = torch.special.gammainc(t, expected.unsqueeze(-1).expand_as(t))
    first = tail.sum(-1)
    second = ((2 * j - 1) * tail).sum(-1)
    return first, (second - first**2).clamp(min=0)


def _by_device(
    values: torch.Tensor, devices: torch.Tensor, num_devices: int, per_layer: bool = False
) -> torch.Tensor:
    """(m, L, E) values of rows on devices (m, L, E) -> (m, D) summed per device ((m, L, D) with
    per_layer)."""
    out = torch.zeros(*values.shape[:-1], num_devices, dtype=values.dtype)
    out.scatter_add_(2, devices, values)  # (m, L, D)
    return out if per_layer else out.sum(1)
