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
        already holds for it. For each expert, only the tokens routed to it are projected; the cache
        stores their K/V under (sequence, layer, expert) and attends their queries over that cache.
        """
        c = self.config
        H, Hkv, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        routing = self.route(x)                                              # (N, E)
        out = torch.zeros_like(x)
        for expert in range(c.num_attention_experts):
            rows = routing.selected[:, expert].nonzero().squeeze(1)          # (n,) tokens sent here
            if rows.numel() == 0:
                continue
            xe, pe = x[rows], positions[rows]                                # (n, D), (n,)
            q = rotary((xe @ self.w_q[expert]).view(-1, H, Dh), pe, c.rope_theta)    # (n, H, Dh)
            k = rotary((xe @ self.w_k[expert]).view(-1, Hkv, Dh), pe, c.rope_theta)  # (n, Hkv, Dh)
            v = (xe @ self.w_v[expert]).view(-1, Hkv, Dh)                            # (n, Hkv, Dh)
            attn = cache.attend(self.layer_index, expert, seq_ids[rows], pe, q, k, v)  # (n, H, Dh)
            y = attn.reshape(-1, H * Dh) @ self.w_o[expert]                  # (n, D)
            out.index_add_(0, rows, routing.gates[rows, expert, None] * y)
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                         # (N, D)
        routing = route(self.router(x), "topk", self.config.num_experts_per_tok)  # (N, E)
        out = torch.zeros_like(x)
        for expert in range(self.config.num_local_experts):
            rows = routing.selected[:, expert].nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            h = F.silu(xe @ self.w_gate[expert]) * (xe @ self.w_up[expert])  # (n, F)
            out.index_add_(0, rows, routing.gates[rows, expert, None] * (h @ self.w_down[expert]))
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

    def set_routing(self, routing: str, threshold: float | None = None) -> None:
        """Switch attention routing at inference time (the weights do not depend on it)."""
        self.config = self.config.with_routing(routing, threshold)
        for block in self.blocks:
            block.attention.config = self.config
            block.ffn.config = self.config

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
