"""Draft proposers for speculative decoding: where the k tokens the target verifies come from.

* :class:`NgramProposer` (``--draft ngram``, vLLM's prompt lookup): no model. The longest n-gram
  at the end of a sequence that occurred before in it (prompt and output so far) proposes the
  tokens that followed that earlier occurrence. Pays off where the output quotes its context
  (summaries, extraction, code edits), proposes nothing otherwise.
* :class:`DraftModelProposer`: a smaller model with the same tokenizer, or the quantized
  checkpoint of the target itself, run by its own :class:`ModelRunner` over its own paged KV pool.

Both answer ``propose(seqs, budgets)`` with at most ``budgets[i]`` tokens per sequence (and, for
sampled requests of a model draft, the distributions they were drawn from), see the prompts the
target prefilled (``prefill``), hear how many were accepted (``accepted``) and forget sequences that
left the running batch (``retain``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from quantkit.engine.block_manager import BlockManager
from quantkit.engine.model_runner import ExtendRequest, ModelRunner
from quantkit.engine.sampler import request_generator, sampling_probs
from quantkit.engine.sequence import Sequence
from quantkit.errors import QuantkitError


@dataclass
class Proposal:
    """Per sequence: the draft tokens, and (model drafts, sampled requests) their distributions
    [len(tokens), target vocab] (None: drawn deterministically, e.g. greedy or n-gram)."""
    tokens: list[list[int]]
    probs: list[Optional[torch.Tensor]] = field(default_factory=list)


class NgramProposer:
    """Prompt lookup: an index per sequence of where each n-gram (``min_n`` <= n <= ``max_n``) last
    ended, grown by the tokens committed since the last call (never by draft tokens)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise QuantkitError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[int, tuple[dict, list[int]]] = {}  # seq_id -> (n-gram -> end, [indexed up to])

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> Proposal:
        return Proposal([self._lookup(seq, k) if k > 0 else [] for seq, k in zip(seqs, budgets)],
                        [None] * len(seqs))

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        toks = seq.token_ids
        last_ends, upto = self.index.setdefault(seq.seq_id, ({}, [0]))
        # index the n-grams ending before the last token: the last one is the suffix looked up
        for end in range(upto[0], len(toks) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                last_ends[tuple(toks[end - n + 1:end + 1])] = end
        upto[0] = max(upto[0], len(toks) - 1)
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            end = last_ends.get(tuple(toks[-n:]))
            if end is not None:
                return toks[end + 1:end + 1 + k]
        return []

    def prefill(self, seqs: list[Sequence]) -> None:
        pass  # the index grows lazily, from the committed tokens

    def accepted(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        pass  # the index only ever holds committed tokens

    def retain(self, live_ids: set[int]) -> None:
        for sid in [s for s in self.index if s not in live_ids]:
            del self.index[sid]


@dataclass
class _DraftState:
    shadow: Sequence  # the target sequence's tokens (then the draft's own) and the draft pool's blocks
    computed: int = 0  # positions whose draft K/V is in the draft's cache
    proposed: int = 0  # tokens proposed in the current step


class DraftModelProposer:
    """A draft model run by its own ModelRunner and KV pool (no prefix caching: its blocks follow
    one target sequence each). A step first catches the draft up on the sequence's tokens it has
    not seen (the whole prompt once, afterwards the one or two tokens the last verification added),
    whose last logits give the first draft token, then runs one decode step per further token.

    ``min_confidence`` (dynamic draft length, as transformers' ``assistant_confidence_threshold``):
    a sequence stops drafting this step once the draft gave its latest token a probability below it
    (greedy: the top probability; sampled: the drawn token's). Why: where the draft is unsure the
    target usually rejects, so further draft steps are wasted and the verification grows by a row
    each; where it is sure, drafting runs on to ``k``. The target's output is unchanged either way
    (greedy: every verified token is the target's argmax; sampled: the stopping rule reads only the
    draft's own distributions, so rejection sampling stays exact)."""

    name = "model"

    def __init__(self, model, target_vocab: int, num_blocks: int, block_size: int = 16,
                 kv_cache_dtype="auto", max_num_seqs: int = 64, min_confidence: float = 0.0, **runner_kwargs):
        if not 0.0 <= min_confidence < 1.0:
            raise QuantkitError(f"the draft confidence threshold must be in [0, 1), got {min_confidence}")
        self.min_confidence = min_confidence
        self.runner = ModelRunner(model, block_size=block_size, kv_cache_dtype=kv_cache_dtype, num_blocks=num_blocks,
                                  max_num_seqs=max_num_seqs, **runner_kwargs)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.vocab = target_vocab
        self.states: dict[int, _DraftState] = {}

    # ------------------------------------------------------------------ proposing
    def prefill(self, seqs: list[Sequence]) -> None:
        """Run the draft over the prompts the target prefilled in this step (all but the token it
        just sampled), so the first speculative step only catches up on that token: the draft's
        prompt pass is prefill work, as the target's is, not a cost of decoding. A sequence the
        draft pool cannot hold now is left to the catch-up of a later step."""
        fresh = []
        for seq in seqs:
            st = self.states.get(seq.seq_id)
            if st is not None and st.computed:
                continue
            shadow = Sequence(seq.token_ids[:-1], seq.sampling_params, seq.block_size)
            if not self.block_manager.can_append(shadow):
                continue
            st = self.states[seq.seq_id] = _DraftState(shadow)
            self.block_manager.ensure(shadow, len(shadow))
            fresh.append(st)
        if fresh:
            self._prefill_states(fresh)

    def _prefill_states(self, states: list[_DraftState]) -> torch.Tensor:
        """Prefill each state's shadow sequence from position 0; logits after its last token, [B, V]."""
        for st in states:
            st.shadow.num_cached_tokens = 0
        logits = self.runner.run([st.shadow for st in states], True)
        for st in states:
            st.computed = len(st.shadow)
        return logits

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> Proposal:
        out = Proposal([[] for _ in seqs], [None] * len(seqs))
        active = [i for i, k in enumerate(budgets) if k > 0 and self._make_room(seqs[i], k)]
        if not active:
            return out
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        logits = self._catch_up([seqs[i] for i in active])
        step, unsure = active, set()
        for j in range(max(budgets[i] for i in active)):
            if j:
                step = [i for i in step if budgets[i] > j and i not in unsure]
                if not step:
                    break
                shadows = [self.states[seqs[i].seq_id].shadow for i in step]
                for sh, i in zip(shadows, step):
                    sh.append_token(out.tokens[i][-1])
                logits = self.runner.run(shadows, False)
            logits = logits[:, :self.vocab]  # a larger draft vocabulary is cut to the target's
            argmax = logits.argmax(dim=-1).tolist()
            top = self._top_probability(logits) if self.min_confidence > 0 else None
            for row, i in enumerate(step):
                if seqs[i].sampling_params.greedy:
                    out.tokens[i].append(argmax[row])
                    confidence = None if top is None else top[row]
                else:
                    tok, q = self._draw(seqs[i], logits[row])
                    out.tokens[i].append(tok)
                    probs[i].append(q)
                    confidence = float(q[tok])
                if confidence is not None and confidence < self.min_confidence:
                    unsure.add(i)
        for i in active:
            st = self.states[seqs[i].seq_id]
            st.proposed = len(out.tokens[i])
            st.computed = len(seqs[i]) + st.proposed - 1  # the last draft token was never run
            if probs[i]:
                out.probs[i] = torch.stack(probs[i])
        return out

    def _make_room(self, seq: Sequence, k: int) -> bool:
        """The sequence's draft state with blocks for the K/V this step writes (up to position
        len + k - 2); a sequence the draft pool cannot hold proposes nothing this step."""
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = _DraftState(Sequence(seq.token_ids, seq.sampling_params, seq.block_size))
        st.shadow.token_ids = list(seq.token_ids)
        st.proposed = 0
        if self.block_manager.can_append(st.shadow, k - 1):
            self.block_manager.ensure(st.shadow, len(seq) + k - 1)
            return True
        self.block_manager.deallocate(st.shadow)  # start over when room comes back
        st.computed = 0
        return False

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run each sequence's tokens the draft has not seen; logits after the last one, [B, V]. A new
        sequence goes through the prefill path (attention over its fresh K/V), the others through
        an extend step over their cached prefix."""
        states = [self.states[s.seq_id] for s in seqs]
        fresh = [i for i, st in enumerate(states) if st.computed == 0]
        rest = [i for i, st in enumerate(states) if st.computed > 0]
        rows: dict[int, torch.Tensor] = {}
        if fresh:
            for i, row in zip(fresh, self._prefill_states([states[i] for i in fresh])):
                rows[i] = row
        if rest:
            reqs = [ExtendRequest(states[i].shadow.block_table, states[i].computed,
                                  seqs[i].token_ids[states[i].computed:]) for i in rest]
            for i, row in zip(rest, self.runner.run_extend(reqs, last_only=True)):
                rows[i] = row
        return torch.stack([rows[i] for i in range(len(seqs))])

    @staticmethod
    def _top_probability(logits: torch.Tensor) -> list[float]:
        """Per row, the softmax probability of the argmax: 1 / sum(exp(logits - max))."""
        lg = logits.float()
        return (1.0 / torch.exp(lg - lg.amax(dim=-1, keepdim=True)).sum(dim=-1)).tolist()

    def _draw(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A sampled request's draft token and the distribution it was drawn from, over the target's
        vocabulary (a smaller draft vocabulary padded with zero probability)."""
        q = sampling_probs(logits[None], [seq.sampling_params])[0]
        if q.shape[0] < self.vocab:
            q = torch.cat([q, q.new_zeros(self.vocab - q.shape[0])])
        return int(torch.multinomial(q, 1, generator=request_generator(seq, q.device))), q

    # ------------------------------------------------------------------ after verification
    def accepted(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Keep the draft K/V of accepted tokens only; release blocks past them."""
        for seq, n in zip(seqs, num_accepted):
            st = self.states.get(seq.seq_id)
            if st is None or st.proposed == 0:
                continue
            start = st.computed - st.proposed + 1  # the sequence's length before the step
            st.computed = min(st.computed, start + n)
            del st.shadow.token_ids[st.computed:]
            self.block_manager.rollback(st.shadow)

    def retain(self, live_ids: set[int]) -> None:
        for sid in [s for s in self.states if s not in live_ids]:
            self.block_manager.deallocate(self.states.pop(sid).shadow)
