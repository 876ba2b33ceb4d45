"""Train the embedded `tiny` model on the Python standard library's own source files.

Every machine with Python has this corpus, so nothing is downloaded and nothing is committed but
the weights. Byte-level next-token prediction, AdamW, cosine schedule, plus the Switch Transformer
load-balancing loss (Fedus et al., arXiv 2101.03961, eq. 4) on every router, weighted lightly so that
experts stay in use but are free to specialise.

    python -m moekv_ref.apps.train --minutes 12 --out moekv_ref/weights/tiny.pt
"""

from __future__ import annotations

import argparse
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import DEFAULT_CHECKPOINT, save_checkpoint
from ..config import get_config
from ..model import MoEKVTransformer
from ..paths import output_path
from ..routing import Routing
from . import options


def stdlib_corpus(max_files: int | None = None) -> tuple[bytes, bytes]:
    """(train, validation) bytes from the standard library's .py files; every 20th file validates."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))  # top level only: same set on every CPython 3.11
    if max_files:
        files = files[:max_files]
    train, valid = [], []
    for i, path in enumerate(files):
        data = path.read_bytes()
        (valid if i % 20 == 0 else train).append(data)
    return b"\n".join(train), b"\n".join(valid)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """E * sum_e f_e * P_e: f_e the fraction of selections that went to e, P_e its mean probability."""
    probs = routing.probs.reshape(-1, routing.probs.shape[-1])
    selected = routing.selected.reshape(-1, routing.selected.shape[-1]).to(probs.dtype)
    fraction = selected.sum(0) / selected.sum()
    return probs.shape[-1] * (fraction * probs.mean(0)).sum()


def batches(data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
        yield window[:, :-1].long(), window[:, 1:].long()


@torch.no_grad()
def evaluate(model, data: torch.Tensor, context: int, num_batches: int = 8) -> float:
    generator = torch.Generator().manual_seed(1234)
    losses = []
    for _, (x, y) in zip(range(num_batches), batches(data, 16, context, generator)):
        logits = model(x).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
    return sum(losses) / len(losses)


def fit(
    model: MoEKVTransformer,
    train_data: torch.Tensor,
    *,
    batch_size: int,
    context: int,
    lr: float = 3e-3,
    balance_weight: float = 0.01,
    seed: int = 0,
    minutes: float | None = None,
    num_steps: int | None = None,
    state_path: Path | None = None,
    on_step=None,
    save_every: int = 50,
) -> int:
    """Train `model` in place: AdamW, 100 warm-up steps, then a cosine decay over the budget, which is
    either wall-clock `minutes` (how the embedded model was trained) or `num_steps` (a token budget:
    num_steps * batch_size * context bytes, the same on every machine). Returns the steps taken.

    With `state_path`, the model, optimizer, step and data order are saved there every `save_every` steps and
    at the end, and a run that finds the file continues from it (step budgets only: a wall-clock
    schedule cannot resume). on_step(step, loss) is called after every step."""
    if (minutes is None) == (num_steps is None):
        raise ValueError("give exactly one budget: minutes or num_steps")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    step = 0
    if state_path is not None and num_steps is not None and Path(state_path).exists():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        step = int(state["step"])

    def save():
        if state_path is not None and num_steps is not None:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": generator.get_state(),
                    "step": step,
                },
                state_path,
            )

    start = time.time()
    stream = batches(train_data, batch_size, context, generator)
    model.train()
    while True:
        elapsed = time.time() - start
        progress = elapsed / (minutes * 60) if minutes is not None else step / num_steps
        if progress >= 1:
            break
        for group in optimizer.param_groups:  # warm-up then cosine
            group["lr"] = lr * min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * progress))
        x, y = next(stream)
        output = model(x)
        loss = F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), y.reshape(-1))
        balance = sum(load_balancing_loss(r) for r in output.attention_routing + output.ffn_routing)
        optimizer.zero_grad(set_to_none=True)
        (loss + balance_weight * balance).backward()
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


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors of stdlib_corpus()."""
    train_bytes, valid_bytes = stdlib_corpus()
    return (
        torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8),
        torch.frombuffer(bytearray(valid_bytes), dtype=torch.uint8),
    )


def train(
    minutes: float,
    out: Path,
    batch_size: int = 16,
    context: int = 256,
    lr: float = 3e-3,
    balance_weight: float = 0.01,
    seed: int = 0,
) -> MoEKVTransformer:
    torch.manual_seed(seed)
    random.seed(seed)
    train_data, valid_data = load_corpus()
    print(
        f"corpus: {train_data.numel() / 1e6:.1f} MB train, {valid_data.numel() / 1e6:.2f} MB validation "
        f"(stdlib *.py)",
        flush=True,
    )
    model = MoEKVTransformer(get_config("tiny"))
    print(f"model: {model.num_parameters() / 1e6:.2f} M parameters", flush=True)
    start = time.time()

    def report(step, loss):
        if step % 50 == 0:
            print(
                f"step {step:5d}  {(time.time() - start) / 60:5.1f}/{minutes:.0f} min  loss {loss:.3f}",
                flush=True,
            )

    step = fit(
        model,
        train_data,
        batch_size=batch_size,
        context=context,
        lr=lr,
        balance_weight=balance_weight,
        seed=seed,
        minutes=minutes,
        on_step=report,
    )
    valid_loss = evaluate(model, valid_data, context)
    train_seconds = time.time() - start
    print(
        f"done: {step} steps in {train_seconds / 60:.1f} min, validation loss {valid_loss:.3f} nats/byte "
        f"({valid_loss / math.log(2):.2f} bits/byte)",
        flush=True,
    )
    metadata = {
        "steps": step,
        "train_seconds": round(train_seconds),
        "validation_loss": round(valid_loss, 4),
        "batch_size": batch_size,
        "context": context,
        "corpus": "CPython stdlib top-level *.py",
    }
    save_checkpoint(model, output_path(out), metadata)
    print(f"saved {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return model


def check_args(args) -> None:
    """--out is written after the training's minutes: checked before they start."""
    options.output_file("--out", args.out, parents_made=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = options.parse_checked(parser, argv, check_args)
    train(args.minutes, args.out, batch_size=args.batch_size, context=args.context, seed=args.seed)


if __name__ == "__main__":
    main()
