"""Continuous batching: which sequences run in the next step, and whether it is a prefill or a decode.

* A waiting request is admitted (prefilled) as soon as a running slot (``max_num_seqs``) and its
  KV blocks are free and the step's token budget (``max_num_batched_tokens``) allows; prefill steps
  go first, so new requests join the running batch at the next step.
* Otherwise every running sequence decodes one token. If the pool has no block for a sequence's
  next token, the newest running sequence is preempted: its blocks are freed and it goes back to
  the front of the queue, to be recomputed (prompt + tokens generated so far) when blocks free up.
* A finished sequence leaves the batch and frees its blocks at once.
* With speculative decoding (``num_lookahead_tokens`` k) a decode step also reserves slots for the
  k draft tokens each sequence verifies after its last token (fewer near ``max_tokens``); the
  engine hands the slots of rejected ones back (``BlockManager.rollback``) after the step.
"""
from __future__ import annotations

from collections import deque

from quantkit.engine.block_manager import BlockManager
from quantkit.engine.sequence import Sequence, SequenceStatus
from quantkit.errors import QuantkitError


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192,
                 eos_token_ids: frozenset = frozenset(), num_lookahead_tokens: int = 0):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise QuantkitError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Refuse a request that could never fit the pool even alone (it would wait forever)."""
        max_len = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        need = -(-max_len // self.block_manager.block_size)
        if need > self.block_manager.num_blocks:
            raise QuantkitError(
                f"a request of {seq.num_prompt_tokens} prompt + {seq.sampling_params.max_tokens} new tokens needs "
                f"{need} KV blocks but the pool has {self.block_manager.num_blocks}; give the KV cache more memory "
                "or shorten the request")

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill step (empty list: nothing to run)."""
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # a prompt longer than the whole budget is prefilled alone rather than never
            if (scheduled and num_tokens + len(seq) > self.max_num_batched_tokens) or not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            num_tokens += len(seq) - seq.prefill_start
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True

        budget = min(self.max_num_seqs, max(1, self.max_num_batched_tokens // (1 + self.num_lookahead_tokens)))
        while self.running and len(scheduled) < budget:
            seq = self.running.popleft()
            lookahead = self.lookahead(seq)
            while not bm.can_append(seq, lookahead):
                if self.running:
                    self.preempt(self.running.pop())  # the newest
                else:
                    self.preempt(seq)
                    break
            else:
                bm.may_append(seq, lookahead)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def lookahead(self, seq: Sequence) -> int:
        """Speculative tokens ``seq`` may verify this step: the step emits up to one more than it
        verifies, so never more than its remaining tokens minus one."""
        remaining = seq.sampling_params.max_tokens - seq.num_completion_tokens
        return max(0, min(self.num_lookahead_tokens, remaining - 1))

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], now: float) -> list[Sequence]:
        """Append each sequence's new token; finish, free and return the ones that are done."""
        return self.postprocess_many(seqs, [[t] for t in token_ids], now)[0]

    def postprocess_many(self, seqs: list[Sequence], new_tokens: list[list[int]],
                         now: float) -> tuple[list[Sequence], list[list[int]]]:
        """Append each sequence's new tokens (several after a speculative step) up to the first that
        finishes it; finish and free the sequences that are done. Returns (finished, the tokens
        appended to each sequence)."""
        finished, appended = [], []
        for seq, toks in zip(seqs, new_tokens):
            taken = []
            for tok in toks:
                taken.append(tok)
                if self._append(seq, tok, now):
                    finished.append(seq)
                    break
            appended.append(taken)
        return finished, appended

    def _append(self, seq: Sequence, tok: int, now: float) -> bool:
        """Append one token; finish and free ``seq`` when it is done (returns whether it is)."""
        seq.append_token(tok)
        if seq.first_token_time is None:
            seq.first_token_time = now
        sp = seq.sampling_params
        reason = None
        if (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids:
            reason = "stop"
        elif seq.num_completion_tokens >= sp.max_tokens:
            reason = "length"
        if reason is None:
            return False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        return True
