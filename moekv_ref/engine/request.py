"""A request and the states it moves through.

    add_request ──> WAITING ──admit──> RUNNING ──last token──> FINISHED (finish_reason "length")
                       ^                  │
                       └──── PREEMPTED <──┘ preempt (recompute: blocks freed; swap: blocks copied
                              (resume)               to the CPU swap space, then freed)

    from any unfinished state: abort ──> FINISHED ("aborted"); its own sampling fails ──> FINISHED
    ("error", with the reason); its blocks and swap blocks go back at once.

Token bookkeeping (vLLM v1's): `all_token_ids` = prompt + generated tokens, of which
`num_computed_tokens` have K/V in the cache. A step runs the next ones (a prompt, a chunk of it, a
decode token, or everything so far after a recompute) and, once all are computed, samples one more.

A request owns its `torch.Generator`, seeded from its SamplingParams, and preemption never resamples
a token, so a preempted request produces exactly what it would have produced alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams
from ..state import Stateful


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request(Stateful):
    STATE = (  # what a step changes (moekv_ref/state.py); the engine restores the generator
        "status",
        "output_token_ids",
        "num_computed_tokens",
        "swapped",
        "predicted_blocks",
        "actual_blocks",
        "final_token_counts",
        "num_preemptions",
        "num_recomputed_tokens",
        "prefix_hit",
        "finished_step",
        "finish_reason",
        "error",
    )

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    swapped: bool = False  # preempted by swap (its blocks wait in the swap space)
    # statistics
    predicted_blocks: int | None = None  # the admission prediction, made when first admitted
    actual_blocks: int | None = None  # blocks it held when it finished
    final_token_counts: torch.Tensor | None = None  # (L, E) tokens its rows held when it finished
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    prefix_hit: object | None = None  # the cache/prefix_cache.PrefixHit it last started from, if any
    finished_step: int | None = None
    finish_reason: str | None = None  # "length" (all its tokens), "aborted", or "error"
    error: str | None = None  # why, when finish_reason is "error"

    def __post_init__(self):
        self.generator: torch.Generator = self.sampling_params.generator()

    # ----- the transitions (the scheduler calls them; the diagram in the module docstring) -----------
    def admit(self, predicted_blocks: int) -> None:
        """WAITING -> RUNNING for the first time, with the blocks admission predicted for it."""
        self.predicted_blocks = predicted_blocks
        self.status = RequestStatus.RUNNING

    def resume(self) -> None:
        """PREEMPTED -> RUNNING."""
        self.status = RequestStatus.RUNNING

    def start_from_prefix(self, hit) -> None:
        """Its first hit.num_tokens tokens' K/V come from the prefix cache's blocks."""
        self.num_computed_tokens = hit.num_tokens
        self.prefix_hit = hit

    def leave_swap_space(self) -> None:
        """Its blocks are back in the device pool (or dropped from the swap space)."""
        self.swapped = False

    def preempt(self, swapped: bool) -> None:
        """RUNNING -> PREEMPTED, its blocks in the swap space (swapped) or freed."""
        self.status = RequestStatus.PREEMPTED
        self.swapped = swapped
        self.num_preemptions += 1

    def forget_computed(self, recomputed: bool = True) -> int:
        """Its K/V are gone: every token runs again. Returns how many computed tokens were lost,
        counted as recomputed unless recomputed=False (a prefix copy that never completed)."""
        lost = self.num_computed_tokens
        if recomputed:
            self.num_recomputed_tokens += lost
        self.num_computed_tokens = 0
        return lost

    def advance(self, num_tokens: int) -> None:
        """A step ran its next num_tokens tokens."""
        self.num_computed_tokens += num_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def finish(
        self, step: int, reason: str, error: str | None, actual_blocks: int, final_token_counts: torch.Tensor
    ) -> None:
        """Any unfinished state -> FINISHED, with what it held at the end."""
        self.actual_blocks = actual_blocks
        self.final_token_counts = final_token_counts
        self.swapped = False
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finished_step = step

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to run before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens

    @property
    def max_cached_tokens(self) -> int:
        """Tokens the cache holds at the end: the last sampled token is never fed back."""
        return len(self.prompt_token_ids) + self.max_new_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def generated_token_ids(self) -> list[int]:
        """The output without the tokens a padded (static) batch decodes past it."""
        return self.output_token_ids[: self.sampling_params.max_new_tokens]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    num_preemptions: int
    predicted_blocks: int | None
    actual_blocks: int | None
    finish_reason: str | None = None  # "length", "aborted", "error"; None while unfinished
    error: str | None = None

    @classmethod
    def from_request(cls, request: Request) -> "RequestOutput":
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.generated_token_ids,
            request.num_preemptions,
            request.predicted_blocks,
            request.actual_blocks,
            request.finish_reason,
            request.error,
        )
