"""A request as the engine sees it: its tokens (prompt + generated), sampling parameters and block table."""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from enum import Enum, auto
from typing import Optional, Sequence as Seq

from quantkit.errors import QuantkitError


@dataclass
class SamplingParams:
    """How to pick each next token.

    ``temperature=0`` is greedy (argmax). Otherwise logits are divided by the temperature, then
    ``top_k`` (0 or -1: off) keeps the k most likely tokens and ``top_p`` (1.0: off) the smallest
    set whose probability reaches p, and the token is drawn from what remains. ``seed`` gives the
    request its own random generator, so its output does not depend on what it is batched with.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: Optional[int] = None
    stop_token_ids: tuple = ()

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # NaN fails both
            raise QuantkitError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise QuantkitError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise QuantkitError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise QuantkitError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids of one request plus the engine's bookkeeping for it."""

    _ids = itertools.count()

    def __init__(self, token_ids: Seq[int], sampling_params: SamplingParams, block_size: int):
        if len(token_ids) == 0:
            raise QuantkitError("a prompt needs at least one token")
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = [int(t) for t in token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # tokens whose K/V came from the prefix cache at the last allocation
        self.generator = None  # created by the sampler on the logits' device when a seed is set
        self.finish_reason: Optional[str] = None
        self.num_preemptions = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def prefill_start(self) -> int:
        """First position a prefill must compute: cached prefix blocks are skipped, but at least the
        last token is always run (its logits pick the next token), even when every block was cached."""
        return min(self.num_cached_tokens, len(self.token_ids) - 1)

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))
