"""One rank's model step under expert parallelism.

A sequence's home rank holds its hidden states between layers and runs the replicated parts
(embedding, norms, routers, residual adds, LM head). Per layer:

    h = attention_norm(x)                      at home
    x = x + attention(h)                       the KV placement decides what travels (kv_placements.py)
    h = ffn_norm(x)                            at home
    x = x + combine(experts(dispatch(h)))      FFN experts are expert-parallel in every placement

which is `Block.forward` of model.py with the experts' work moved to their ranks; the logits equal
the single-process model's (tests/spec/test_parallel.py). Every rank calls `step` at every step, with an
empty batch if need be, as each layer's collectives pair up across ranks. `traffic` counts per
step the integers the cost model needs.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from ..cache import PagedKVCache
from ..model import MoEKVTransformer, swiglu_experts
from .comm import Communicator
from .dispatch import DispatchPlan, combine, dispatch, local_pairs
from .kv_placements import KV_PLACEMENTS, PLACEMENT_CLASSES
from .shard import RankShard


class ParallelRunner:
    """attention_ranks (L, E) and ffn_ranks (L, E_ffn): the rank of every expert (placement.py);
    replicated_attention ignores attention_ranks."""

    def __init__(
        self,
        model: MoEKVTransformer,
        comm: Communicator,
        kv_placement: str,
        attention_ranks,
        ffn_ranks,
        num_blocks: int,
        block_size: int = 16,
    ):
        if kv_placement not in KV_PLACEMENTS:
            raise ValueError(f"kv_placement={kv_placement!r} is not one of {KV_PLACEMENTS}")
        config = model.config
        if config.attention_capacity:
            raise ValueError(
                f"attention_capacity={config.attention_capacity}: expert parallelism does not run "
                "models with a capacity yet (their ranks' caches would need the budget, and each "
                "pair's router score sent with it); run them in one process"
            )
        attention_ranks = torch.as_tensor(attention_ranks, dtype=torch.int64)
        ffn_ranks = torch.as_tensor(ffn_ranks, dtype=torch.int64)
        shapes = {
            "attention_ranks": (attention_ranks, config.num_attention_experts),
            "ffn_ranks": (ffn_ranks, config.num_local_experts),
        }
        for name, (ranks, num_experts) in shapes.items():
            if ranks.shape != (config.num_hidden_layers, num_experts):
                raise ValueError(
                    f"{name} must be (layers, experts) = ({config.num_hidden_layers}, "
                    f"{num_experts}), got {tuple(ranks.shape)}"
                )
            if ranks.numel() and not (0 <= int(ranks.min()) and int(ranks.max()) < comm.world_size):
                raise ValueError(f"{name} holds ranks outside [0, {comm.world_size})")
        self.comm, self.ffn_ranks = comm, ffn_ranks
        replicated = kv_placement == "replicated_attention"
        self.shard = RankShard(model, comm.rank, None if replicated else attention_ranks, ffn_ranks)
        parameter = next(model.parameters())
        self.cache = PagedKVCache(
            config, num_blocks, block_size, dtype=parameter.dtype, device=parameter.device
        )
        self.attention = PLACEMENT_CLASSES[kv_placement](self.shard, comm, self.cache, attention_ranks)
        self.traffic: dict[int, Counter] = {}
        self.step_seconds: dict[int, float] = {}

    @torch.no_grad()
    def step(
        self, step: int, tokens: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """This rank's home tokens (N,) of a flat ragged batch -> logits (N, V). Every rank calls it."""
        self.comm.start_step(step)
        traffic = self.traffic.setdefault(step, Counter())
        start = time.perf_counter()
        x = self.shard.embed(tokens)  # (N, D)
        for layer, part in enumerate(self.shard.layers):
            x = x + self.attention.forward(layer, part.attention_norm(x), seq_ids, positions, traffic)
            x = x + self._ffn(layer, part.ffn_norm(x), traffic)
        logits = self.shard.lm_head(self.shard.norm(x))  # (N, V)
        self.step_seconds[step] = self.step_seconds.get(step, 0.0) + time.perf_counter() - start
        return logits

    def _ffn(self, layer: int, h: torch.Tensor, traffic: Counter) -> torch.Tensor:
        part = self.shard.layers[layer]
        routing = self.shard.route_ffn(layer, h)  # (N, E_ffn)
        plan = DispatchPlan.build(
            routing.selected,
            routing.gates,
            self.ffn_ranks[layer],
            self.comm.world_size,
            self.shard.config.num_experts_per_tok,
        )
        traffic["ffn_pairs_to_peers"] += plan.pairs_to_peers(self.comm.rank)
        traffic["ffn_expert_pairs_to_peers"] += plan.expert_pairs_to_peers(self.comm.rank)
        received = dispatch(self.comm, plan, h, "ffn_dispatch")
        pairs = local_pairs(received, part.ffn_experts)
        y = swiglu_experts(
            received.hidden[pairs.token],
            pairs.counts,
            part.w_gate,
            part.w_up,
            part.w_down,
            self.shard.backend,
        )  # (M, D)
        return combine(self.comm, plan, received, pairs, y, h.shape[0], "ffn_combine")

    def pool_usage(self) -> dict[str, int]:
        manager = self.cache.manager
        return {
            "num_blocks": manager.num_blocks,
            "used_blocks": manager.num_blocks - manager.num_free_blocks,
            "tokens": int(manager.row_tokens.sum()),
            "kv_bytes": self.cache.kv_bytes(),
        }
