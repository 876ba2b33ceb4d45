"""Notebook 08's exercise: a split size for split-K decode attention."""

from __future__ import annotations

from ..cache.rows import ceil_div
from ..costs import GPUS
from ..validation import is_integer
from .checks import MISSING, RIGHT, WRONG, wrapped

EXERCISE_08_NUM_ROWS = 4  # the split-K line of the report: 4 rows x 32768 tokens, Hkv 4
EXERCISE_08_CONTEXT = 32768
EXERCISE_08_NUM_KV_HEADS = 4
EXERCISE_08_NUM_SMS = GPUS["H100"].num_sms  # 132, H100 SXM and H200
EXERCISE_08_TOKEN_TILE = 16  # TOKEN_TILE at Dh = 128: a split is a whole number of tiles


def split_k_programs(
    tokens_per_split: int,
    num_rows: int = EXERCISE_08_NUM_ROWS,
    context: int = EXERCISE_08_CONTEXT,
    num_kv_heads: int = EXERCISE_08_NUM_KV_HEADS,
) -> int:
    """Programs of one split-K launch: one per (row, KV head, split of tokens_per_split tokens)."""
    return num_rows * num_kv_heads * ceil_div(context, tokens_per_split)


def solution_tokens_per_split(blocks_per_sm: int, num_sms: int = EXERCISE_08_NUM_SMS) -> int:
    """The largest multiple of the token tile whose launch has a program for every resident-block slot
    of the GPU (num_sms x blocks_per_sm), so that no SM waits for work."""
    needed = num_sms * blocks_per_sm
    candidates = range(EXERCISE_08_CONTEXT, 0, -EXERCISE_08_TOKEN_TILE)
    return next(t for t in candidates if split_k_programs(t) >= needed)


@wrapped
def check_tokens_per_split(answer, blocks_per_sm: int, num_sms: int = EXERCISE_08_NUM_SMS) -> str:
    """Is `answer` the largest tokens_per_split (a multiple of the 16-token tile) that gives every
    resident-block slot of the GPU a program?"""
    needed = num_sms * blocks_per_sm
    per_split = EXERCISE_08_NUM_ROWS * EXERCISE_08_NUM_KV_HEADS
    if answer is None:
        return (
            f"{MISSING}: replace None with a tokens_per_split. Hint: the launch runs {EXERCISE_08_NUM_ROWS} "
            f"rows x {EXERCISE_08_NUM_KV_HEADS} KV heads = {per_split} programs per split; the GPU holds "
            f"{num_sms} SMs x {blocks_per_sm} blocks at once."
        )
    if not is_integer(answer) or answer < 1:
        return f"{WRONG}: {answer!r} must be a positive whole number of tokens."
    if answer % EXERCISE_08_TOKEN_TILE:
        rounded = ceil_div(answer, EXERCISE_08_TOKEN_TILE) * EXERCISE_08_TOKEN_TILE
        return (
            f"{WRONG}: {answer} is not a multiple of the {EXERCISE_08_TOKEN_TILE}-token tile the kernel "
            f"walks a split in; the launcher would round it up to {rounded}. Give a multiple of "
            f"{EXERCISE_08_TOKEN_TILE}."
        )
    programs = split_k_programs(answer)
    right = solution_tokens_per_split(blocks_per_sm, num_sms)
    splits = ceil_div(EXERCISE_08_CONTEXT, answer)
    if programs < needed:
        return (
            f"{WRONG}: {splits} split(s) per row give {programs} programs, fewer than the {needed} "
            f"({num_sms} SMs x {blocks_per_sm} resident blocks) the GPU can run at once: "
            f"{100 * (1 - programs / needed):.0f}% of its slots wait for work, and a decode kernel that "
            f"cannot keep enough loads in flight runs below memory bandwidth. Use smaller splits."
        )
    if answer == right:
        return (
            f"{RIGHT}: {splits} splits per row, {programs} programs for {needed} slots. Twice as large "
            f"({2 * answer} tokens) gives {split_k_programs(2 * answer)} programs and leaves SMs idle; "
            f"smaller splits would only add partial results for the combine kernel to read back."
        )
    return (
        f"{WRONG}: {programs} programs fill the {needed} slots, but a larger split fills them too; every "
        f"program beyond what the GPU needs writes a partial output and its log-sum-exp that the "
        f"combine kernel must read back: more bytes for nothing. Take the largest split that still "
        f"fills it."
    )
