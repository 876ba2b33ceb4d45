"""The one training loop every program trains the model code with (apps/train.py's embedded model,
apps/family.py's variants, apps/study_pilot.py's recall study).

`fit` is AdamW (weight decay 0.1, betas 0.9 and 0.95), a linear warm-up then a cosine decay over
the budget, the Switch Transformer load-balancing loss (Fedus et al., arXiv 2101.03961, eq. 4) on
every router, weighted lightly so that experts stay in use but are free to specialise, and the
gradient clipped at norm 1. The budget is wall-clock minutes (how the embedded model was trained)
or a number of steps (the same work on every machine). What differs between the programs comes in
as arguments: the batches (`random_windows` of a corpus, or the recall study's windows), the
forward (the model's own, or study/train_fast.py's fused one) and per-target weights.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .model import MoEKVTransformer
from .routing import Routing


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """E * sum_e f_e * P_e: f_e the fraction of selections that went to e, P_e its mean probability."""
    probs = routing.probs.reshape(-1, routing.probs.shape[-1])
    selected = routing.selected.reshape(-1, routing.selected.shape[-1]).to(probs.dtype)
    fraction = selected.sum(0) / selected.sum()
    return probs.shape[-1] * (fraction * probs.mean(0)).sum()


def random_windows(data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator):
    """next_batch(step) -> (x, y) (batch_size, context) int64: windows of the byte tensor `data` at
    starts drawn from `generator`, y the bytes after x. The draws depend on the generator's state
    alone, so a run that restores it (fit's `generator`) sees the batches it would have seen."""

    def next_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
        return window[:, :-1].long(), window[:, 1:].long()

    return next_batch


def fit(
    model: MoEKVTransformer,
    next_batch,
    *,
    num_steps: int | None = None,
    minutes: float | None = None,
    forward=None,
    lr: float = 3e-3,
    warmup: int = 100,
    balance_weight: float = 0.01,
    generator: torch.Generator | None = None,
    state_path: Path | None = None,
    save_every: int = 50,
    on_step=None,
) -> int:
    """Train `model` in place (module docstring) and return the steps taken.

    next_batch(step) -> (x, y) (B, T) int64, or (x, y, weights) with each target's weight (B, T)
    (the loss is then the weighted mean). forward(model, x) -> ModelOutput, the model's own by
    default. Exactly one budget: `num_steps`, or wall-clock `minutes`. balance_weight 0 leaves the
    load-balancing loss out.

    With `state_path` (a step budget only: a wall-clock schedule cannot resume) the model, the
    optimizer, the step and `generator`'s state (the data order, if the batches draw from one) are
    saved there every `save_every` steps and at the end, and a run finding the file continues from
    it. on_step(step, loss) is called after every step with the cross-entropy alone."""
    if (minutes is None) == (num_steps is None):
        raise ValueError("give exactly one budget: minutes or num_steps")
    resumable = state_path is not None and num_steps is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = 0
    if resumable and Path(state_path).exists():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if generator is not None:
            generator.set_state(state["generator"])
        step = int(state["step"])

    def save():
        if not resumable:
            return
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        if generator is not None:
            state["generator"] = generator.get_state()
        partial = Path(str(state_path) + ".tmp")  # written whole, then renamed: a crash leaves the last one
        torch.save(state, partial)
        partial.replace(state_path)

    start = time.time()
    model.train()
    while True:
        progress = (time.time() - start) / (minutes * 60) if minutes is not None else step / num_steps
        if progress >= 1:
            break
        for group in optimizer.param_groups:  # warm-up then cosine
            group["lr"] = lr * min(1.0, step / warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        x, y, *weights = next_batch(step)
        output = model(x) if forward is None else forward(model, x)
        if weights:
            nats = F.cross_entropy(output.logits.flatten(0, 1), y.flatten(), reduction="none")
            loss = (nats * weights[0].flatten()).sum() / weights[0].sum()
        else:
            loss = F.cross_entropy(output.logits.flatten(0, 1), y.flatten())
        total = loss
        if balance_weight:
            routings = output.attention_routing + output.ffn_routing
            total = loss + balance_weight * sum(load_balancing_loss(r) for r in routings)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if on_step is not None:
            on_step(step, loss.item())
        if step % save_every == 0:
            save()
    save()
    model.eval()
    return step
