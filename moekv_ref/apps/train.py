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
from ..routing import Routing


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


def train(minutes: float, out: Path, batch_size: int = 16, context: int = 256, lr: float = 3e-3,
          balance_weight: float = 0.01, seed: int = 0) -> MoEKVTransformer:
    torch.manual_seed(seed)
    random.seed(seed)
    train_bytes, valid_bytes = stdlib_corpus()
    train_data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    valid_data = torch.frombuffer(bytearray(valid_bytes), dtype=torch.uint8)
    print(f"corpus: {len(train_bytes) / 1e6:.1f} MB train, {len(valid_bytes) / 1e6:.2f} MB validation "
          f"(stdlib *.py)", flush=True)
    model = MoEKVTransformer(get_config("tiny"))
    print(f"model: {model.num_parameters() / 1e6:.2f} M parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    budget = minutes * 60
    start = time.time()
    step = 0
    for x, y in batches(train_data, batch_size, context, generator):
        elapsed = time.time() - start
        if elapsed > budget:
            break
        progress = elapsed / budget
        for group in optimizer.param_groups:  # warm-up then cosine, by wall-clock progress
            group["lr"] = lr * min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * progress))
        output = model(x)
        loss = F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), y.reshape(-1))
        balance = sum(load_balancing_loss(r) for r in output.attention_routing + output.ffn_routing)
        optimizer.zero_grad(set_to_none=True)
        (loss + balance_weight * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            print(f"step {step:5d}  {elapsed / 60:5.1f}/{minutes:.0f} min  loss {loss.item():.3f}  "
                  f"balance {balance.item() / (2 * model.config.num_hidden_layers):.3f}", flush=True)
        step += 1
    model.eval()
    valid_loss = evaluate(model, valid_data, context)
    train_seconds = time.time() - start
    print(f"done: {step} steps in {train_seconds / 60:.1f} min, validation loss {valid_loss:.3f} nats/byte "
          f"({valid_loss / math.log(2):.2f} bits/byte)", flush=True)
    metadata = {"steps": step, "train_seconds": round(train_seconds), "validation_loss": round(valid_loss, 4),
                "batch_size": batch_size, "context": context, "corpus": "CPython stdlib top-level *.py"}
    save_checkpoint(model, out, metadata)
    print(f"saved {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train(args.minutes, args.out, batch_size=args.batch_size, context=args.context, seed=args.seed)


if __name__ == "__main__":
    main()
