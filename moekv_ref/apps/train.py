"""Train the embedded `tiny` model on the Python standard library's own source files.

Every machine with Python has this corpus, so nothing is downloaded and nothing is committed but
the weights. Byte-level next-token prediction, trained by training.py's `fit` (AdamW, cosine
schedule, the load-balancing loss on every router) for a wall-clock budget.

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
from ..training import fit, random_windows
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


def evaluate(model, data: torch.Tensor, context: int, num_batches: int = 8) -> float:
    next_batch = random_windows(data, 16, context, torch.Generator().manual_seed(1234))
    losses = []
    for step in range(num_batches):
        x, y = next_batch(step)
        logits = model(x).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
    return sum(losses) / len(losses)


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

    generator = torch.Generator().manual_seed(seed)
    step = fit(
        model,
        random_windows(train_data, batch_size, context, generator),
        minutes=minutes,
        lr=lr,
        balance_weight=balance_weight,
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
