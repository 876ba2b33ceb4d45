"""What one rank holds of the model: the experts placed on it, and the small parts every rank needs.

Every rank builds the same full `MoEKVTransformer` and keeps its part: replicated are the embedding,
RMSNorms, routers (each rank routes its own tokens), final norm and LM head; sharded are the experts
whose rank is this one (every attention expert under replicated_attention). The slices are copies,
so the full model can be dropped and `weight_bytes` counts what the rank really holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model import ExpertAttention, MoEKVTransformer, RMSNorm
from ..routing import Routing, route


@dataclass
class LayerShard:
    attention_norm: RMSNorm
    ffn_norm: RMSNorm
    attention: ExpertAttention | None  # the whole layer, only when attention is replicated
    attention_router: nn.Linear
    attention_experts: torch.Tensor  # (E_local,) global ids held here, ascending
    w_q: torch.Tensor  # (E_local, D, H*Dh)
    w_k: torch.Tensor  # (E_local, D, Hkv*Dh)
    w_v: torch.Tensor
    w_o: torch.Tensor  # (E_local, H*Dh, D)
    ffn_router: nn.Linear
    ffn_experts: torch.Tensor  # (F_local,) global ids held here
    w_gate: torch.Tensor  # (F_local, D, F)
    w_up: torch.Tensor
    w_down: torch.Tensor  # (F_local, F, D)


class RankShard:
    """One rank's part of the model; attention_ranks=None replicates attention on every rank."""

    def __init__(
        self,
        model: MoEKVTransformer,
        rank: int,
        attention_ranks: torch.Tensor | None,
        ffn_ranks: torch.Tensor,
    ):
        self.config = model.config
        self.backend = model.backend
        self.embed, self.norm, self.lm_head = model.embed, model.norm, model.lm_head
        self.layers: list[LayerShard] = []
        for layer, block in enumerate(model.blocks):
            attention, ffn = block.attention, block.ffn
            if attention_ranks is None:
                attention_experts = torch.arange(self.config.num_attention_experts)
            else:
                attention_experts = (torch.as_tensor(attention_ranks[layer]) == rank).nonzero().squeeze(1)
            ffn_experts = (torch.as_tensor(ffn_ranks[layer]) == rank).nonzero().squeeze(1)
            qkvo = [
                self._keep(w, attention_experts)
                for w in (attention.w_q, attention.w_k, attention.w_v, attention.w_o)
            ]
            gate_up_down = [self._keep(w, ffn_experts) for w in (ffn.w_gate, ffn.w_up, ffn.w_down)]
            whole = attention if attention_ranks is None else None
            self.layers.append(
                LayerShard(
                    block.attention_norm,
                    block.ffn_norm,
                    whole,
                    attention.router,
                    attention_experts,
                    *qkvo,
                    ffn.router,
                    ffn_experts,
                    *gate_up_down,
                )
            )

    @staticmethod
    def _keep(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Experts `ids` of weight (E, ...): a copy of a subset, the tensor itself for all."""
        return weight.detach() if ids.numel() == weight.shape[0] else weight.detach()[ids].clone()

    def route_attention(self, layer: int, x: torch.Tensor) -> Routing:
        c = self.config
        return route(
            self.layers[layer].attention_router(x),
            c.attention_routing,
            c.num_attention_experts_per_tok,
            c.routing_threshold,
        )

    def route_ffn(self, layer: int, x: torch.Tensor) -> Routing:
        return route(self.layers[layer].ffn_router(x), "topk", self.config.num_experts_per_tok)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights this rank holds: replicated parts, attention experts, FFN experts."""

        def size(*tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        replicated = size(*self.embed.parameters(), *self.norm.parameters(), *self.lm_head.parameters())
        attention = ffn = 0
        for shard in self.layers:
            replicated += size(
                *shard.attention_norm.parameters(),
                *shard.ffn_norm.parameters(),
                *shard.attention_router.parameters(),
                *shard.ffn_router.parameters(),
            )
            attention += size(shard.w_q, shard.w_k, shard.w_v, shard.w_o)
            ffn += size(shard.w_gate, shard.w_up, shard.w_down)
        return {
            "replicated": replicated,
            "attention_experts": attention,
            "ffn_experts": ffn,
            "total": replicated + attention + ffn,
        }
