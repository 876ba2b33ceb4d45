"""A small MoE transformer whose attention experts each keep their own KV cache.

The attention layer has two forwards that must agree: `forward_full` (the padded batch, every
expert computed densely and masked by routing: the recompute reference and the training path) and
`forward_cached` (a flat ragged batch of prefill chunks and decode tokens, only the selected
(token, expert) pairs projected, their K/V stored and attended by the cache).

Dimension legend:
  B batch   T tokens per sequence   N tokens in a flat ragged batch   L layers
  E experts   K experts per token   D model width   H heads   Hkv key/value heads   Dh head width
  F feed-forward width   V vocabulary
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from .attention import rotary, rotary_turns
from .backends import BACKENDS, require_backend
from .config import ModelConfig
from .profiling import phase
from .routing import Routing, apply_capacity, route


@runtime_checkable
class RowRule(Protocol):
    """What `model(tokens, budget=...)` needs of a budget: the model computes each layer's rotated
    q, k, v and routing, and the budget says what each (sequence, expert) row keeps and attends.
    cache/budget.py's RowBudget is one; the model imports nothing from the caches."""

    def check_model(self, num_layers: int, num_experts: int) -> None:
        """ValueError for a budget this model cannot have."""

    def recompute_attention(self, q, k, v, selected, scores, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k, v (B, E, H, T, Dh), selected and scores (B, T, E): attention (B, E, H, T, Dh), zero
        where a pair is not routed or refused, and accepted (B, T, E)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x * rsqrt(mean(x^2) + eps) * weight, as PyTorch's one fused op (five ops otherwise); the op
        # itself, not F.rms_norm's wrapper, which costs as much again at decode sizes (measured)
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def sort_by_expert(selected: torch.Tensor):
    """The (token, expert) pairs of selected (N, E) sorted by expert, stably: a sequence's tokens
    reach each expert's cache in position order. token (M,), expert (M,), counts (E,)."""
    token, expert = selected.nonzero(as_tuple=True)  # (M,) sorted by token
    expert, order = torch.sort(expert, stable=True)  # (M,) sorted by expert
    token = token[order]
    return token, expert, torch.bincount(expert, minlength=selected.shape[1])


def _grouped_mm_applies(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """torch._grouped_mm runs float32 and half precision on a CPU (not float64), has no backward we
    rely on, and on a GPU wants shapes and dtypes of its own: so CPU inference in those dtypes only."""
    return (
        hasattr(torch, "_grouped_mm")
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == weights.dtype
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def grouped_matmul(
    x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, backend: str, offs=None
) -> torch.Tensor:
    """x (M, D) sorted by expert, counts[e] rows for expert e, times weights[e] (E, D, F): (M, F).

    torch: one matmul per expert's slice, the readable reference; where it applies, one
    `torch._grouped_mm` (bitwise equal to the loop, 1.6x faster for a decode step's four FFN experts,
    measured; offs: int32 cumsum(counts), if made). triton: the GEMM kernel (moekv_kernels/expert_gemm.py)."""
    if weights.shape[0] == 0:  # no experts, so no rows (a rank holding none of a layer's experts)
        return x.new_zeros(x.shape[0], weights.shape[-1])
    if backend == "triton":
        import moekv_kernels  # sets TRITON_INTERPRET=1 when no GPU is visible, before triton loads

        return moekv_kernels.expert_gemm(x, weights, counts)
    if weights.shape[0] == 1:  # one expert (dense attention): every row is its
        return x @ weights[0]
    if _grouped_mm_applies(x, weights):
        return torch._grouped_mm(
            x, weights, offs=torch.cumsum(counts, 0, dtype=torch.int32) if offs is None else offs
        )
    return torch.cat([rows @ w for rows, w in zip(torch.split(x, counts.tolist()), weights)])


def project_qkv(config: ModelConfig, xs, turns, counts, w_qkv, backend: str):
    """q (M, H, Dh), k and v (M, Hkv, Dh) of rows xs (M, D) sorted by expert, rotated by turns
    (M, 1, Dh/2), in one product: w_qkv (E', D, (H + 2 Hkv) Dh) is W_q, W_k, W_v side by side, of any
    subset of the layer's experts (a rank's own, under expert parallelism)."""
    H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv = grouped_matmul(xs, w_qkv, counts, backend).unflatten(1, (-1, Dh))  # (M, H + 2 Hkv, Dh)
    qk = rotary(qkv[:, : H + Hkv], turns)  # queries and keys at once
    return qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]


def swiglu_experts(xs, counts, w_gate, w_up, w_down, backend: str) -> torch.Tensor:
    """SwiGLU of rows xs (M, D) sorted by expert, for any subset of experts (as project_qkv)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # the three products' groups
    h = F.silu(grouped_matmul(xs, w_gate, counts, backend, offs)) * grouped_matmul(
        xs, w_up, counts, backend, offs
    )
    return grouped_matmul(h, w_down, counts, backend, offs)  # (M, D)


def swiglu_every_expert(x, gates, w_gate, w_up, w_down) -> torch.Tensor:
    """SwiGLU of every expert on every token of x (N, D), summed by gates (N, E), zero where not chosen."""
    h = F.silu(torch.matmul(x, w_gate)) * torch.matmul(x, w_up)  # (E, N, F)
    return torch.matmul(h * gates.T[:, :, None], w_down).sum(0)  # (N, D)


def dense_pairs(N: int, device, dtype) -> tuple[Routing, torch.Tensor, torch.Tensor]:
    """One attention expert: every token goes to it with gate 1. The routing `route` would give, each
    pair's expert (N,) and the expert's count (1,): the same at every layer, so made once a forward."""
    ones = torch.ones(N, 1, device=device, dtype=dtype)
    return (
        Routing(ones, ones.bool(), ones),
        torch.zeros(N, dtype=torch.int64, device=device),
        torch.tensor([N]),
    )


class ExpertAttention(nn.Module):
    """E attention experts, each with its own W_q, W_k, W_v, W_o, behind a token-choice router.

    For each token t and each expert e in its selection S_t:
        q, k, v = W_q^e x_t, W_k^e x_t, W_v^e x_t        (rotated at t's absolute position)
        a_t^e   = attention of q over the keys of the tokens routed to e at positions <= t
        y_t     = sum_e gate_{t,e} * W_o^e a_t^e
    With E = 1 and k = 1 this is ordinary (grouped-query) attention.
    """

    def __init__(self, config: ModelConfig, layer_index: int, backend: str = "torch"):
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.backend = backend  # of the cached path's projections
        if config.shared_kv:
            raise ValueError(
                f"{config.name} shares K/V between its attention experts (shared_kv=True), which is "
                "for sizing only: this model gives each expert its own K/V"
            )
        E, D = config.num_attention_experts, config.hidden_size
        H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.router = nn.Linear(D, E, bias=False)
        # W_q, W_k, W_v: views of one buffer, which the cached forward's one product for the three reads
        self._qkv = torch.cat(
            [
                torch.randn(E, D, H * Dh) * D**-0.5,
                torch.randn(E, D, Hkv * Dh) * D**-0.5,
                torch.randn(E, D, Hkv * Dh) * D**-0.5,
            ],
            dim=2,
        )  # (E, D, (H + 2 Hkv) Dh)
        self.w_q, self.w_k, self.w_v = (
            nn.Parameter(w) for w in self._qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], 2)
        )
        self._qkv_views = self._layout()
        self.w_o = nn.Parameter(torch.randn(E, H * Dh, D) * (H * Dh) ** -0.5 / config.num_hidden_layers**0.5)

    def _layout(self) -> list:  # where W_q, W_k, W_v lie: the buffer's views, or other tensors
        return [(w.data_ptr(), w.shape, w.stride(), w.dtype) for w in (self.w_q, self.w_k, self.w_v)]

    def qkv_weight(self) -> torch.Tensor:
        """(E, D, (H + 2 Hkv) Dh): the buffer W_q, W_k, W_v are views of while they are (in-place writes,
        as an optimizer's, load_state_dict's or p.data.copy_, land in it); a copy where autograd must reach
        them or one was replaced (.to(dtype), p.data = ...). The copy was 10% of notebook 04's widget."""
        parts = (self.w_q, self.w_k, self.w_v)
        if (
            torch.is_grad_enabled() and any(w.requires_grad for w in parts)
        ) or self._layout() != self._qkv_views:
            return torch.cat(parts, dim=2)
        return self._qkv

    def route(self, x: torch.Tensor) -> Routing:
        c = self.config
        return route(
            self.router(x), c.attention_routing, c.num_attention_experts_per_tok, c.routing_threshold
        )

    def forward_full(self, x: torch.Tensor, budget: RowRule | None = None) -> tuple[torch.Tensor, Routing]:
        """x: (B, T, D), right-padded sequences starting at position 0. Returns (B, T, D). With a
        budget, each (sequence, expert) row keeps at most its B tokens, token by token, by the
        budget's own recompute (RowRule): the recompute a budgeted cache must equal."""
        c = self.config
        B, T, _ = x.shape
        E, H, Hkv, Dh = c.num_attention_experts, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        routing = self.route(x)  # (B, T, E)
        if budget is None and c.attention_capacity:  # the config's capacity, over the whole window
            routing = apply_capacity(routing, c.attention_routing, c.attention_capacity)
        q, k, v = (
            einsum(x, w, "b t d, e d f -> b t e f").unflatten(-1, (-1, Dh))
            for w in (self.w_q, self.w_k, self.w_v)
        )  # (B, T, E, H|Hkv, Dh)
        turns = rotary_turns(
            torch.arange(T, device=x.device)[None, :, None].expand(B, T, E), Dh, c.rope_theta, x.dtype
        )
        q = rearrange(rotary(q, turns), "b t e h d -> b e h t d")
        k, v = (
            rearrange(t, "b t e h d -> b e h t d").repeat_interleave(H // Hkv, dim=2)
            for t in (rotary(k, turns), v)
        )  # (B, E, H, T, Dh)
        if budget is not None:  # a refused pair's attention is zero: it adds nothing below
            attn, accepted = budget.recompute_attention(
                q, k, v, routing.selected, routing.probs, self.layer_index
            )
            routing = Routing(routing.probs, accepted, routing.gates * accepted)  # what the rows took
        else:
            # query i at expert e sees key j iff j <= i and j was routed to e; it also always sees
            # itself, so that rows of tokens not routed to e stay finite (their gate is 0 anyway)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
            sent = rearrange(routing.selected, "b t e -> b e t")  # (B, E, T)
            visible = (causal[None, None] & sent[:, :, None, :]) | torch.eye(
                T, dtype=torch.bool, device=x.device
            )
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, :, None])  # (B, E, H, T, Dh)
        attn = rearrange(attn, "b e h t d -> b t e (h d)")  # (B, T, E, H*Dh)
        out = einsum(attn, self.w_o, "b t e f, e f d -> b t e d")  # (B, T, E, D)
        return (out * routing.gates[..., None]).sum(2), routing

    def forward_cached(
        self, x, seq_ids, positions, cache, turns=None, pairs=None
    ) -> tuple[torch.Tensor, Routing]:
        """x: (N, D) new tokens of many sequences, each continuing what the cache holds for it; seq_ids,
        positions: (N,); turns, pairs: rotary_turns, dense_pairs of them if the caller made them. Returns (N, D)."""
        N, c = x.shape[0], self.config
        dense = c.num_attention_experts == 1
        turns = turns if turns is not None else rotary_turns(positions, c.head_dim, c.rope_theta, x.dtype)
        with phase("routing"):
            if dense:  # one expert: the pairs are the tokens
                routing, expert, counts = pairs if pairs is not None else dense_pairs(N, x.device, x.dtype)
                xs, ps, ts, pair_seq_ids = x, positions, turns, seq_ids  # pair i is token i (M = N)
            else:
                routing = self.route(x)  # (N, E)
                token, expert, counts = sort_by_expert(routing.selected)  # (M,), (M,), (E,)
                xs, ps, ts, pair_seq_ids = x[token], positions[token], turns[token], seq_ids[token]
        with phase("projections"):
            q, k, v = project_qkv(c, xs, ts, counts, self.qkv_weight(), self.backend)
        with phase("append_kv"):  # the router's probabilities: what a budget's router_score keeps
            scores = None if dense else routing.probs[token, expert]
            appended = cache.append_kv(self.layer_index, pair_seq_ids, expert, ps, k, v, scores)
        with phase("attend"):
            attn = cache.attend(appended, q)  # (M, H, Dh)
        with phase("projections"):
            y = grouped_matmul(attn.flatten(1), self.w_o, counts, self.backend)  # (M, H*Dh) -> (M, D)
            if not dense:  # each token's pairs, weighted by their gates, summed
                y = torch.zeros_like(x).index_add_(0, token, routing.gates[token, expert, None] * y)
        return y, routing


# Up to this many (token, expert) products an FFN step runs every expert on every token: E/K times the
# arithmetic in a third of the calls (8 decode tokens, 4 experts: a dense step -12% on a CPU, measured)
EVERY_EXPERT_MAX_PRODUCTS = 64


class MoEFeedForward(nn.Module):
    """Top-k mixture of SwiGLU experts (Mixtral's FFN). Position-wise: it holds no KV."""

    def __init__(self, config: ModelConfig, backend: str = "torch"):
        super().__init__()
        self.config = config
        self.backend = backend
        E, D, Fw = config.num_local_experts, config.hidden_size, config.moe_intermediate_size
        self.router = nn.Linear(D, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, D, Fw) * D**-0.5)
        self.w_up = nn.Parameter(torch.randn(E, D, Fw) * D**-0.5)
        self.w_down = nn.Parameter(torch.randn(E, Fw, D) * Fw**-0.5 / config.num_hidden_layers**0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        with phase("routing"):
            routing = route(self.router(x), "topk", self.config.num_experts_per_tok)  # (N, E)
        with phase("ffn"):
            if self.backend == "torch" and x.shape[0] * self.w_gate.shape[0] <= EVERY_EXPERT_MAX_PRODUCTS:
                out = swiglu_every_expert(x, routing.gates, self.w_gate, self.w_up, self.w_down)  # (N, D)
            else:
                token, expert, counts = sort_by_expert(routing.selected)  # (M,), (M,), (E,)
                y = swiglu_experts(
                    x[token], counts, self.w_gate, self.w_up, self.w_down, self.backend
                )  # (M, D)
                out = torch.zeros_like(x).index_add_(0, token, routing.gates[token, expert, None] * y)
        return out.view(shape), routing


class Block(nn.Module):
    """One transformer layer: x + attention(norm(x)), then + ffn(norm(x)). The residual wiring is
    written once, here; the two forwards differ only in how attention gets its keys."""

    def __init__(self, config: ModelConfig, layer_index: int, backend: str):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = ExpertAttention(config, layer_index, backend)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoEFeedForward(config, backend)

    def forward(self, x, cached=None, budget=None) -> tuple[torch.Tensor, Routing, Routing]:
        """x: (B, T, D) full recompute (under a budget, if given), or (N, D) with cached = (seq_ids,
        positions, cache[, pairs])."""
        if cached is None:
            h, attention_routing = self.attention.forward_full(self.attention_norm(x), budget)
        else:
            h, attention_routing = self.attention.forward_cached(self.attention_norm(x), *cached)
        x = x + h
        h, ffn_routing = self.ffn(self.ffn_norm(x))
        return x + h, attention_routing, ffn_routing


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T, V) or (N, V)
    attention_routing: list[Routing]  # one per layer
    ffn_routing: list[Routing]


class MoEKVTransformer(nn.Module):
    """backend "triton": the cached path's expert projections on the grouped GEMM kernel, decode
    attention on the paged kernels for caches made with PagedKVCache.for_model (on a CPU in
    Triton's interpreter). `forward` is always PyTorch's."""

    def __init__(self, config: ModelConfig, backend: str = "torch"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        require_backend(backend)  # triton is installed only where it has wheels (Linux)
        self.config = config
        self.backend = backend
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.blocks = nn.ModuleList(Block(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _check_tokens(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}), got "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        last = int(positions.max()) if positions.numel() else 0
        if last >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {last} is beyond max_position_embeddings={self.config.max_position_embeddings}"
            )

    def forward(self, tokens: torch.Tensor, budget: RowRule | None = None) -> ModelOutput:
        """Full recompute. tokens: (B, T), right-padded; every row starts at position 0. budget (a
        RowRule: cache/budget.py's RowBudget): each (sequence, layer, expert) row keeps at most B
        tokens, as a cache with that budget does."""
        self._check_tokens(tokens, torch.arange(tokens.shape[-1]))
        if budget is not None:
            if not isinstance(budget, RowRule):
                raise ValueError(f"budget={budget!r} must be a RowBudget (moekv_ref.cache.budget) or None")
            budget.check_model(self.config.num_hidden_layers, self.config.num_attention_experts)
        return self._run(self.embed(tokens), None, budget)  # (B, T, V)

    def forward_cached(self, tokens, seq_ids, positions, cache) -> ModelOutput:
        """Cached step over a flat ragged batch. tokens, seq_ids, positions: (N,). Logits (N, V)."""
        if not (tokens.shape == seq_ids.shape == positions.shape) or tokens.dim() != 1:
            raise ValueError(
                f"tokens, seq_ids and positions must be 1-D of equal length, got shapes "
                f"{tuple(tokens.shape)}, {tuple(seq_ids.shape)}, {tuple(positions.shape)}"
            )
        self._check_tokens(tokens, positions)
        dtype, c = next(self.parameters()).dtype, self.config
        if self.backend == "triton" and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"backend='triton' runs float32, float16 or bfloat16 weights, not {dtype}")
        with phase("forward"):
            with phase("projections"):  # every layer's rotations
                cached = (seq_ids, positions, cache, rotary_turns(positions, c.head_dim, c.rope_theta, dtype))
            if c.num_attention_experts == 1:  # every layer's pairs
                cached += (dense_pairs(tokens.shape[0], self.embed.weight.device, self.embed.weight.dtype),)
            return self._run(self.embed(tokens), cached)  # (N, V)

    def _run(self, x, cached, budget=None) -> ModelOutput:
        attention_routing, ffn_routing = [], []
        for block in self.blocks:
            x, r_attn, r_ffn = block(x, cached, budget)
            attention_routing.append(r_attn)
            ffn_routing.append(r_ffn)
        return ModelOutput(self.lm_head(self.norm(x)), attention_routing, ffn_routing)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
