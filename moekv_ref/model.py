"""A small MoE transformer whose attention experts each keep their own KV cache.

One file, top to bottom: RMSNorm, the attention-expert layer, the MoE feed-forward, the block, the
model. The attention layer has two forwards that must agree:

  forward_full    the whole (padded) batch at once, every expert computed densely and masked by
                  routing: the *recompute* reference, and the training path.
  forward_cached  a flat, ragged batch of new tokens (prefill chunks and decode tokens mixed); for
                  each expert only the tokens routed to it are projected, their K/V are handed to a
                  cache, which stores them and returns attention over that expert's cached tokens.

Dimension legend (DESIGN.md §6):
  B batch   T tokens per sequence   N tokens in a flat ragged batch   L layers
  E experts   K experts per token   D model width   H heads   Hkv key/value heads   Dh head width
  F feed-forward width   V vocabulary
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import rotary
from .config import ModelConfig
from .routing import Routing, route


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


BACKENDS = ("torch", "triton")


def sort_by_expert(selected: torch.Tensor):
    """The (token, expert) pairs a routing selected, sorted by expert (tokens ascending within one).

    selected: (N, E) bool. Returns token (M,), expert (M,), counts (E,) with M = selected.sum():
    rows counts[0] .. of a gathered x[token] belong to expert 0, and so on. Within an expert, tokens
    keep their order, so a sequence's tokens reach each expert's cache in position order."""
    token, expert = selected.nonzero(as_tuple=True)                      # (M,) sorted by token
    order = torch.argsort(expert, stable=True)
    token, expert = token[order], expert[order]                          # (M,) sorted by expert
    return token, expert, torch.bincount(expert, minlength=selected.shape[1])


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
    """x (M, D) sorted by expert, counts[e] rows for expert e, times weights[e] (E, D, F): (M, F).

    torch: one matmul per expert's slice, the readable reference. triton: one launch of the grouped
    GEMM kernel (kernels/expert_gemm.py), which pads each expert's rows to the tile internally."""
    if backend == "triton":
        import kernels  # sets TRITON_INTERPRET=1 when no GPU is visible, before triton loads
        return kernels.expert_gemm(x, weights, counts)
    out = x.new_empty(x.shape[0], weights.shape[2])
    start = 0
    for expert, count in enumerate(counts.tolist()):
        out[start:start + count] = x[start:start + count] @ weights[expert]
        start += count
    return out


class ExpertAttention(nn.Module):
    """E attention experts, each with its own W_q, W_k, W_v, W_o, behind a token-choice router.

    For each token t and each expert e in its selection S_t:
        q, k, v = W_q^e x_t, W_k^e x_t, W_v^e x_t        (rotated at t's absolute position)
        a_t^e   = attention of q over the keys of the tokens routed to e at positions <= t
        y_t     = sum_e gate_{t,e} * W_o^e a_t^e
    With E = 1 and k = 1 this is ordinary (grouped-query) attention.
    """

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        E, D = config.num_attention_experts, config.hidden_size
        H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.router = nn.Linear(D, E, bias=False)
        self.w_q = nn.Parameter(torch.randn(E, D, H * Dh) * D**-0.5)
        self.w_k = nn.Parameter(torch.randn(E, D, Hkv * Dh) * D**-0.5)
        self.w_v = nn.Parameter(torch.randn(E, D, Hkv * Dh) * D**-0.5)
        self.w_o = nn.Parameter(torch.randn(E, H * Dh, D) * (H * Dh) ** -0.5 / config.num_hidden_layers**0.5)
        self.backend = "torch"   # of the cached path's projections; see MoEKVTransformer.set_backend

    def route(self, x: torch.Tensor) -> Routing:
        c = self.config
        return route(self.router(x), c.attention_routing, c.num_attention_experts_per_tok, c.routing_threshold)

    def forward_full(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """x: (B, T, D), right-padded sequences starting at position 0. Returns (B, T, D)."""
        c = self.config
        B, T, _ = x.shape
        E, H, Hkv, Dh = c.num_attention_experts, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        routing = self.route(x)                                              # (B, T, E)
        q = torch.einsum("btd,edf->btef", x, self.w_q).view(B, T, E, H, Dh)
        k = torch.einsum("btd,edf->btef", x, self.w_k).view(B, T, E, Hkv, Dh)
        v = torch.einsum("btd,edf->btef", x, self.w_v).view(B, T, E, Hkv, Dh)
        positions = torch.arange(T, device=x.device)[None, :, None].expand(B, T, E)
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        q = q.permute(0, 2, 3, 1, 4)                                         # (B, E, H, T, Dh)
        k = k.permute(0, 2, 3, 1, 4).repeat_interleave(H // Hkv, dim=2)      # (B, E, H, T, Dh)
        v = v.permute(0, 2, 3, 1, 4).repeat_interleave(H // Hkv, dim=2)
        # query i at expert e sees key j iff j <= i and j was routed to e; it also always sees
        # itself, so that rows of tokens not routed to e stay finite (their gate is 0 anyway)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()   # (T, T)
        sent = routing.selected.permute(0, 2, 1)                             # (B, E, T)
        visible = (causal[None, None] & sent[:, :, None, :]) | torch.eye(T, dtype=torch.bool, device=x.device)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, :, None])  # (B, E, H, T, Dh)
        attn = attn.permute(0, 3, 1, 2, 4).reshape(B, T, E, H * Dh)
        out = torch.einsum("btef,efd->bted", attn, self.w_o)                 # (B, T, E, D)
        return (out * routing.gates[..., None]).sum(2), routing

    def forward_cached(self, x, seq_ids, positions, cache) -> tuple[torch.Tensor, Routing]:
        """x: (N, D) new tokens of many sequences; seq_ids, positions: (N,). Returns (N, D).

        Within each sequence the new tokens must be consecutive positions that continue what the cache
        already holds for it. Only the (token, expert) pairs the router selected are projected, as one
        grouped matmul over pairs sorted by expert; the cache stores each expert's K/V under
        (sequence, layer, expert) and attends that expert's queries over its cache.
        """
        c = self.config
        H, Hkv, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        routing = self.route(x)                                              # (N, E)
        token, expert, counts = sort_by_expert(routing.selected)             # (M,), (M,), (E,)
        xs, ps = x[token], positions[token]                                  # (M, D), (M,)
        q = rotary(grouped_matmul(xs, self.w_q, counts, self.backend).view(-1, H, Dh), ps, c.rope_theta)
        k = rotary(grouped_matmul(xs, self.w_k, counts, self.backend).view(-1, Hkv, Dh), ps, c.rope_theta)
        v = grouped_matmul(xs, self.w_v, counts, self.backend).view(-1, Hkv, Dh)   # (M, Hkv, Dh)
        attn = torch.empty_like(q)                                           # (M, H, Dh)
        ends = torch.cumsum(counts, 0).tolist()
        for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            if start == end:
                continue
            pairs = slice(start, end)                                        # expert e's tokens
            attn[pairs] = cache.attend(self.layer_index, e, seq_ids[token[pairs]], ps[pairs],
                                       q[pairs], k[pairs], v[pairs])
        y = grouped_matmul(attn.reshape(-1, H * Dh), self.w_o, counts, self.backend)  # (M, D)
        out = torch.zeros_like(x).index_add_(0, token, routing.gates[token, expert, None] * y)
        return out, routing


class MoEFeedForward(nn.Module):
    """Top-k mixture of SwiGLU experts (Mixtral's FFN). Position-wise: it holds no KV."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        E, D, Fw = config.num_local_experts, config.hidden_size, config.moe_intermediate_size
        self.router = nn.Linear(D, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, D, Fw) * D**-0.5)
        self.w_up = nn.Parameter(torch.randn(E, D, Fw) * D**-0.5)
        self.w_down = nn.Parameter(torch.randn(E, Fw, D) * Fw**-0.5 / config.num_hidden_layers**0.5)
        self.backend = "torch"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                         # (N, D)
        routing = route(self.router(x), "topk", self.config.num_experts_per_tok)  # (N, E)
        token, expert, counts = sort_by_expert(routing.selected)             # (M,), (M,), (E,)
        xs = x[token]                                                        # (M, D) sorted by expert
        h = F.silu(grouped_matmul(xs, self.w_gate, counts, self.backend)) \
            * grouped_matmul(xs, self.w_up, counts, self.backend)            # (M, F)
        y = grouped_matmul(h, self.w_down, counts, self.backend)             # (M, D)
        out = torch.zeros_like(x).index_add_(0, token, routing.gates[token, expert, None] * y)
        return out.view(shape), routing


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = ExpertAttention(config, layer_index)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoEFeedForward(config)


@dataclass
class ModelOutput:
    logits: torch.Tensor                 # (B, T, V) or (N, V)
    attention_routing: list[Routing]     # one per layer
    ffn_routing: list[Routing]


class MoEKVTransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.backend = "torch"

    def set_routing(self, routing: str, threshold: float | None = None) -> None:
        """Switch attention routing at inference time (the weights do not depend on it)."""
        self.config = self.config.with_routing(routing, threshold)
        for block in self.blocks:
            block.attention.config = self.config
            block.ffn.config = self.config

    def set_backend(self, backend: str) -> None:
        """Run the experts' projections (attention Q/K/V/O and FFN) of the cached path as PyTorch
        matmuls ("torch", the default) or as the grouped GEMM Triton kernel ("triton"; on a CPU it
        runs in Triton's interpreter). The full-recompute attention always uses PyTorch; decode
        attention on the kernels is the paged cache's choice (PagedKVCache(backend=...))."""
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        dtype = next(self.parameters()).dtype
        if backend == "triton" and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"backend='triton' runs float32, float16 or bfloat16 weights, not {dtype}")
        self.backend = backend
        for block in self.blocks:
            block.attention.backend = backend
            block.ffn.backend = backend

    def _check_tokens(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        if positions is None:
            last = tokens.shape[-1] - 1
        else:
            last = int(positions.max()) if positions.numel() else 0
        if last >= self.config.max_position_embeddings:
            raise ValueError(f"position {last} is beyond max_position_embeddings="
                             f"{self.config.max_position_embeddings}")

    def forward(self, tokens: torch.Tensor) -> ModelOutput:
        """Full recompute. tokens: (B, T), right-padded; every row starts at position 0."""
        self._check_tokens(tokens)
        x = self.embed(tokens)                                               # (B, T, D)
        attention_routing, ffn_routing = [], []
        for block in self.blocks:
            h, r_attn = block.attention.forward_full(block.attention_norm(x))
            x = x + h
            h, r_ffn = block.ffn(block.ffn_norm(x))
            x = x + h
            attention_routing.append(r_attn)
            ffn_routing.append(r_ffn)
        return ModelOutput(self.lm_head(self.norm(x)), attention_routing, ffn_routing)

    def forward_cached(self, tokens, seq_ids, positions, cache) -> ModelOutput:
        """Cached step over a flat ragged batch. tokens, seq_ids, positions: (N,). Logits (N, V)."""
        if not (tokens.shape == seq_ids.shape == positions.shape) or tokens.dim() != 1:
            raise ValueError(f"tokens, seq_ids and positions must be 1-D of equal length, got shapes "
                             f"{tuple(tokens.shape)}, {tuple(seq_ids.shape)}, {tuple(positions.shape)}")
        self._check_tokens(tokens, positions)
        x = self.embed(tokens)                                               # (N, D)
        attention_routing, ffn_routing = [], []
        for block in self.blocks:
            h, r_attn = block.attention.forward_cached(block.attention_norm(x), seq_ids, positions, cache)
            x = x + h
            h, r_ffn = block.ffn(block.ffn_norm(x))
            x = x + h
            attention_routing.append(r_attn)
            ffn_routing.append(r_ffn)
        return ModelOutput(self.lm_head(self.norm(x)), attention_routing, ffn_routing)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
