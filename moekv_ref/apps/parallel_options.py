"""The values the parallel programs accept (`python -m moekv_ref.apps.parallel_run`, `bench parallel`), as
messages that name the option, the bad value and what is allowed; the programs hand them to
parser.error (exit code 2) before anything starts.

The limits come from the sweep model (parallel_measure.SWEEP_CONFIG): its positions hold the context and every
decode step, and its experts split evenly over the ranks.
"""

from __future__ import annotations

import math

from ..validation import MAX_TIMEOUT_S, is_seconds
from .parallel_measure import SWEEP_CONFIG

MAX_POSITIONS = SWEEP_CONFIG.max_position_embeddings
EXPERTS = math.gcd(SWEEP_CONFIG.num_attention_experts, SWEEP_CONFIG.num_local_experts)
WORLD_SIZES = tuple(d for d in range(1, EXPERTS + 1) if EXPERTS % d == 0)


def one_of(values) -> str:
    """(1, 2, 4) -> "1, 2 or 4"."""
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


def world_size_problem(world_size: int, allowed=WORLD_SIZES, why: str = "") -> str | None:
    """Ranks: a divisor of the sweep model's experts per layer (and one of `allowed`)."""
    if world_size in allowed:
        return None
    return (
        f"must be {one_of(allowed)}: the sweep model has {EXPERTS} experts per layer, and every rank "
        f"holds the same number of them{why}"
    )


def positions_problems(contexts, decode_steps: int, context_option: str = "--context") -> list[str]:
    """The sweep model's positions hold the context and every decode step: problems, as messages."""
    if not 1 <= decode_steps < MAX_POSITIONS:
        return [
            f"--decode-steps {decode_steps}: must be an integer from 1 to {MAX_POSITIONS - 1} (the sweep "
            f"model's max_position_embeddings={MAX_POSITIONS} positions hold the context and the decode steps)"
        ]
    limit = MAX_POSITIONS - decode_steps
    return [
        f"{context_option} {context}: must be an integer from 1 to {limit}: the sweep model's "
        f"max_position_embeddings={MAX_POSITIONS} positions hold the context and the {decode_steps} "
        f"decode steps (--decode-steps {decode_steps})"
        for context in contexts
        if not 1 <= context <= limit
    ]


def seconds_problem(option: str, value: float) -> str | None:
    """A timeout: finite, positive, at most a day (nan and inf parse as floats, so both are checked)."""
    if is_seconds(value):
        return None
    return f"{option} {value:g}: must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f}"
