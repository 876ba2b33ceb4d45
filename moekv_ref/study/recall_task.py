"""Windows of the capacity study's corpus with assignments recalled hundreds of bytes later.

Each window is WINDOW = 1,024 bytes of the CPython standard library's source (apps/train.py's corpus:
training windows from its training files, validation windows from its held-out files, which no
training window touches) with m = 6-8 whole lines inserted at line starts:

    _v37 = 'kqz'            m assignments, their values' bytes within the first 700 bytes
    ...                     the corpus's own lines
    assert _v37 == 'kqz'    the same m names, in another order, within the last 300 bytes

Names are drawn per window from a fixed set (`_v00` .. `_v99`), values are 3 random lowercase
letters, so the only way to predict an assert's value is to read its assignment, 300 to 1,000 bytes
back (value byte to value byte). Everything is drawn from one seed: window i of a split is the same
on every machine.

Two scores per model: retrieval accuracy, the model's greedy prediction of each value byte of the
asserts given the true prefix (chance is 1/26 for a model that knows the values are lowercase), and
bits per byte on every other byte (and on the corpus's own bytes alone).
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAMES = tuple(f"_v{i:02d}" for i in range(100))
VALUE_LETTERS = string.ascii_lowercase
VALUE_LENGTH = 3
CHANCE = 1 / len(VALUE_LETTERS)
# The standard library repeats some passages from file to file (the same deprecation block in several
# network clients, say): a validation window is drawn again where its text shares a run of
# SHARED_PIECE + SHARED_STRIDE - 1 = 79 bytes or more with the training text.
SHARED_PIECE = 64
SHARED_STRIDE = 16
SPLIT_SEEDS = {"train": 0, "validation": 1}  # mixed into each window's seed: the splits never share draws


def assignment_line(name: str, value: str) -> bytes:
    return f"{name} = '{value}'\n".encode()


def assert_line(name: str, value: str) -> bytes:
    return f"assert {name} == '{value}'\n".encode()


ASSIGN_VALUE_OFFSET = len("_v00 = '")  # where the value starts in its line
ASSERT_VALUE_OFFSET = len("assert _v00 == '")
ASSIGN_LENGTH = len(assignment_line("_v00", "abc"))
ASSERT_LENGTH = len(assert_line("_v00", "abc"))


@dataclass(frozen=True)
class RecallSpec:
    """The shape of a task's windows. FULL is the task; DRILL and SHORT, a quarter of its length with
    shorter distances, are a curriculum's first stages."""

    window: int = 1024
    num_assignments: tuple[int, int] = (6, 8)  # m, both ends included
    assign_end: int = 700  # every assignment's value lies before this byte
    assert_start: int = 1024 - 300  # every assert's value lies at or after this byte
    distances: tuple[int, int] = (300, 1000)  # first value byte to its assert's, both ends included
    stacked: bool = False  # whether several lines may go in at one line start (one after another)


FULL = RecallSpec()
# a curriculum's drill: as many assignments as 256 bytes hold, stacked, next to little corpus text
DRILL = RecallSpec(
    window=256, num_assignments=(5, 7), assign_end=128, assert_start=128, distances=(20, 250), stacked=True
)
SHORT = RecallSpec(window=256, num_assignments=(2, 3), assign_end=150, assert_start=176, distances=(40, 250))


@dataclass(frozen=True)
class RecallWindow:
    """One window: its bytes (WINDOW,), where its base text came from (source[start : start +
    base_length] of the split's corpus), and per assignment i (in window order): its name, value, the
    position of its first value byte, and the position of the first value byte of its assert."""

    tokens: torch.Tensor  # (spec.window,) uint8
    start: int
    base_length: int
    names: tuple[str, ...]
    values: tuple[str, ...]
    assign_positions: tuple[int, ...]
    assert_positions: tuple[int, ...]

    @property
    def distances(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.assign_positions, self.assert_positions))


def _line_starts(base: bytes) -> list[int]:
    """Offsets of base that begin a line (after a newline), the end of base included if it ends one."""
    return [i + 1 for i, byte in enumerate(base) if byte == 10]


def shares_text(base: bytes, other: bytes) -> bool:
    """Whether a SHARED_PIECE-byte piece of base at a multiple of SHARED_STRIDE occurs in other: true
    for every base sharing a run of SHARED_PIECE + SHARED_STRIDE - 1 bytes or more with other."""
    last = max(len(base) - SHARED_PIECE, 0)
    return any(base[i : i + SHARED_PIECE] in other for i in range(0, last + 1, SHARED_STRIDE))


def make_window(
    source: bytes, seed: int, spec: RecallSpec = FULL, exclude: bytes | None = None, attempts: int = 1000
) -> RecallWindow:
    """The window of `spec` drawn by random.Random(seed) from source (a split's corpus bytes); with
    `exclude`, a draw whose base text shares a run of text with it (shares_text) is drawn again."""
    rng = random.Random(seed)
    for _ in range(attempts):
        m = rng.randint(*spec.num_assignments)
        names = rng.sample(NAMES, m)
        values = ["".join(rng.choice(VALUE_LETTERS) for _ in range(VALUE_LENGTH)) for _ in range(m)]
        base_length = spec.window - m * (ASSIGN_LENGTH + ASSERT_LENGTH)
        start = rng.randrange(0, len(source) - base_length)
        base = source[start : start + base_length]
        starts = _line_starts(base)
        # the k-th assignment (k earlier ones before it) at base offset p has its value at
        # p + k * ASSIGN_LENGTH + ASSIGN_VALUE_OFFSET; the j-th assert after all m assignments and j
        # asserts, at p + m * ASSIGN_LENGTH + j * ASSERT_LENGTH + ASSERT_VALUE_OFFSET
        early = [p for p in starts if p + (m - 1) * ASSIGN_LENGTH + ASSIGN_VALUE_OFFSET < spec.assign_end]
        late = [p for p in starts if p + m * ASSIGN_LENGTH + ASSERT_VALUE_OFFSET >= spec.assert_start]
        if spec.stacked:
            if not early or not late:
                continue
            assign_at = sorted(rng.choices(early, k=m))
            assert_at = sorted(rng.choices(late, k=m))
            if assign_at[-1] > assert_at[0]:
                continue
        else:
            if len(early) < m or len(late) < m or max(early) >= min(late):
                continue
            assign_at = sorted(rng.sample(early, m))
            assert_at = sorted(rng.sample(late, m))
        assign_positions = [p + k * ASSIGN_LENGTH + ASSIGN_VALUE_OFFSET for k, p in enumerate(assign_at)]
        slot_positions = [
            p + m * ASSIGN_LENGTH + j * ASSERT_LENGTH + ASSERT_VALUE_OFFSET for j, p in enumerate(assert_at)
        ]
        order = list(range(m))  # order[j]: the assignment the j-th assert recalls
        rng.shuffle(order)
        assert_positions = [0] * m
        for j, i in enumerate(order):
            assert_positions[i] = slot_positions[j]
        distances = [b - a for a, b in zip(assign_positions, assert_positions)]
        if not all(spec.distances[0] <= d <= spec.distances[1] for d in distances):
            continue
        if exclude is not None and shares_text(base, exclude):  # last: the slowest check
            continue
        pieces, cursor = [], 0
        inserts = [(p, assignment_line(names[k], values[k])) for k, p in enumerate(assign_at)]
        inserts += [(p, assert_line(names[order[j]], values[order[j]])) for j, p in enumerate(assert_at)]
        for p, line in inserts:  # assignments all precede asserts, both in base order
            pieces += [base[cursor:p], line]
            cursor = p
        pieces.append(base[cursor:])
        data = b"".join(pieces)
        return RecallWindow(
            tokens=torch.frombuffer(bytearray(data), dtype=torch.uint8),
            start=start,
            base_length=base_length,
            names=tuple(names),
            values=tuple(values),
            assign_positions=tuple(assign_positions),
            assert_positions=tuple(assert_positions),
        )
    raise ValueError(f"no window found in {attempts} attempts: source of {len(source)} bytes is too short")


def window_seed(split: str, seed: int, index: int) -> int:
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split={split!r} is not allowed; allowed: {tuple(SPLIT_SEEDS)}")
    return (seed * 1_000_003 + index) * 2 + SPLIT_SEEDS[split]


def make_windows(
    source: bytes,
    split: str,
    seed: int,
    first: int,
    count: int,
    spec: RecallSpec = FULL,
    exclude: bytes | None = None,
) -> list[RecallWindow]:
    """Windows first .. first + count - 1 of a split for a seed: each one a function of (split, seed,
    index) alone, so a run resumed at any step draws the same windows it would have."""
    return [
        make_window(source, window_seed(split, seed, i), spec, exclude) for i in range(first, first + count)
    ]


def batch(windows: list[RecallWindow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, y (B, WINDOW - 1) int64 inputs and next-byte targets; probe (B, WINDOW - 1) bool: the targets
    that are an assert's value bytes; text (B, WINDOW - 1) bool: the targets from the corpus's own bytes."""
    tokens = torch.stack([w.tokens for w in windows]).long()
    probe = torch.zeros(tokens.shape, dtype=torch.bool)
    inserted = torch.zeros(tokens.shape, dtype=torch.bool)
    for b, w in enumerate(windows):
        for a, s in zip(w.assign_positions, w.assert_positions):
            probe[b, s : s + VALUE_LENGTH] = True
            inserted[b, a - ASSIGN_VALUE_OFFSET : a - ASSIGN_VALUE_OFFSET + ASSIGN_LENGTH] = True
            inserted[b, s - ASSERT_VALUE_OFFSET : s - ASSERT_VALUE_OFFSET + ASSERT_LENGTH] = True
    return tokens[:, :-1], tokens[:, 1:], probe[:, 1:], ~inserted[:, 1:]


@dataclass
class Scores:
    """Sums over windows, so that batches add up: probe value bytes predicted right, probe values
    with all their bytes right, and negative log-likelihoods (nats) with their counts."""

    probe_bytes: int = 0
    probe_correct: int = 0
    values: int = 0
    values_correct: int = 0
    other_nats: float = 0.0
    other_bytes: int = 0
    text_nats: float = 0.0
    text_bytes: int = 0

    def add(self, logits: torch.Tensor, y: torch.Tensor, probe: torch.Tensor, text: torch.Tensor) -> None:
        """logits (B, T, V) of inputs whose next bytes are y (B, T)."""
        nats = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="none").view(y.shape)
        right = logits.argmax(-1) == y  # greedy, given the true prefix
        self.probe_bytes += int(probe.sum())
        self.probe_correct += int((right & probe).sum())
        per_value = right[probe].view(-1, VALUE_LENGTH)  # each assert's value bytes are consecutive
        self.values += per_value.shape[0]
        self.values_correct += int(per_value.all(1).sum())
        self.other_nats += float(nats[~probe].sum())
        self.other_bytes += int((~probe).sum())
        self.text_nats += float(nats[text].sum())
        self.text_bytes += int(text.sum())

    def summary(self) -> dict:
        accuracy = self.probe_correct / self.probe_bytes
        low, high = wilson_interval(self.probe_correct, self.probe_bytes)
        value_low, value_high = wilson_interval(self.values_correct, self.values)
        return {
            "retrieval_accuracy": accuracy,
            "retrieval_interval_95": [low, high],
            "probe_bytes": self.probe_bytes,
            "value_accuracy": self.values_correct / self.values,
            "value_interval_95": [value_low, value_high],
            "probe_values": self.values,
            "bits_per_byte_other": self.other_nats / self.other_bytes / math.log(2),
            "bits_per_byte_text": self.text_nats / self.text_bytes / math.log(2),
            "other_bytes": self.other_bytes,
            "text_bytes": self.text_bytes,
        }


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return (max(0.0, centre - half), min(1.0, centre + half))
