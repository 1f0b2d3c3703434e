"""Speculative decoding in the paged-KV engine: a draft proposes, the target verifies k tokens in
one forward, and the output is what the target alone would have produced.

One speculative decode step, for every running sequence at once (acceptance is per sequence, so
it works with continuous batching):

1. the scheduler reserved KV slots for each sequence's last token and up to k draft tokens after it
   (fewer near ``max_tokens``; ``Scheduler.lookahead``);
2. the proposer drafts them (a draft model, or n-gram lookup: ``engine.proposers``);
3. the target runs ``[last token, draft tokens...]`` of every sequence as one extend forward over
   the paged cache (``ModelRunner.run_extend``), writing their K/V, with logits after each;
4. ``engine.rejection_sampler`` keeps a leading run of draft tokens and adds one target token
   (greedy: identical to the target alone; sampling: exactly the target's distribution);
5. the engine appends them, hands the slots of rejected tokens back (``BlockManager.rollback``:
   they were never hashed, so the prefix cache only ever holds committed tokens) and the proposer
   drops its own K/V past the accepted run.

Why it pays: a batch-1 decode step streams every weight once for one token; verifying k + 1
tokens streams them once too, so each accepted draft token costs only the draft's step. Expected
speed-up: E[tokens per step] / (k c + 1), c = draft step cost / target step cost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.engine.model_runner import ExtendRequest, ModelRunner
from quantkit.engine.proposers import DraftModelProposer, NgramProposer, Proposal
from quantkit.engine.rejection_sampler import accept_greedy, rejection_sample
from quantkit.engine.sampler import Sampler, request_generator, sampling_probs
from quantkit.engine.sequence import Sequence
from quantkit.errors import QuantkitError


@dataclass
class SpeculativeStep:
    """What one speculative step produced, per sequence, and where its time went."""
    tokens: list[list[int]]  # to append: accepted draft tokens + one target token
    proposed: list[int]
    accepted: list[int]
    draft_s: float
    verify_s: float


def check_same_tokenizer(tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft that does not speak the target's token ids. With both tokenizers, their
    vocabularies must map every token to the same id; without, the embedding sizes must agree."""
    if tokenizer is not None and draft_tokenizer is not None:
        if tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise QuantkitError(f"the draft's tokenizer differs from the target's ({len(draft_tokenizer)} vs "
                                f"{len(tokenizer)} tokens, ids not the same); use a draft with the target's tokenizer "
                                "(its quantized checkpoint, a smaller model of the same family) or --draft ngram")
    elif target_vocab != draft_vocab:
        raise QuantkitError(f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}); "
                            "use a draft with the target's tokenizer or --draft ngram")


def make_proposer(draft, runner: ModelRunner, num_speculative_tokens: int, max_num_seqs: int, tokenizer=None,
                  draft_tokenizer=None, kv_cache_dtype="auto", draft_confidence: float = 0.0, **runner_kwargs):
    """``"ngram"``, a proposer object, or a draft model (run with a KV pool of the target's block count
    plus room for every sequence's draft tokens; ``draft_confidence``: DraftModelProposer's
    ``min_confidence``, a draft model's only)."""
    if draft_confidence and (isinstance(draft, str) or hasattr(draft, "propose")):
        raise QuantkitError(f"draft_confidence {draft_confidence} needs a draft model (it reads the draft's "
                            "probabilities); leave it at 0 with an n-gram or custom proposer")
    if isinstance(draft, str):
        if draft.strip().lower() != "ngram":
            raise QuantkitError(f"draft {draft!r} is not a model; pass a loaded model, a path through the CLI/API, "
                                "or 'ngram'")
        return NgramProposer()
    if hasattr(draft, "propose"):
        return draft
    target_vocab = runner.embed.num_embeddings
    draft_vocab = draft.get_input_embeddings().num_embeddings
    check_same_tokenizer(tokenizer, draft_tokenizer, target_vocab, draft_vocab)
    spare = max_num_seqs * (-(-num_speculative_tokens // runner.block_size) + 1)
    return DraftModelProposer(draft, target_vocab, runner.num_blocks + spare, runner.block_size, kv_cache_dtype,
                              max_num_seqs, draft_confidence, **runner_kwargs)


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, proposer, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise QuantkitError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.runner, self.proposer, self.k = runner, proposer, num_speculative_tokens
        self.sampler = Sampler()

    def step(self, seqs: list[Sequence], budgets: list[int]) -> SpeculativeStep:
        """Propose up to ``budgets[i]`` tokens per sequence, verify, accept (blocks for them are reserved)."""
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, budgets)
        t1 = time.perf_counter()
        if any(proposal.tokens):
            reqs = [ExtendRequest(s.block_table, len(s) - 1, [s.last_token] + d) for s, d in zip(seqs, proposal.tokens)]
            tokens = self._accept(seqs, proposal, self.runner.run_extend(reqs))
        else:  # nothing to verify: a plain decode step
            tokens = [[t] for t in self.sampler(self.runner.run(seqs, False), seqs)]
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        proposed = [len(d) for d in proposal.tokens]
        return SpeculativeStep(tokens, proposed, [len(t) - 1 for t in tokens], t1 - t0, time.perf_counter() - t1)

    def _accept(self, seqs: list[Sequence], proposal: Proposal, logits: torch.Tensor) -> list[list[int]]:
        """Per sequence, the accepted draft tokens and the target's next token. logits [B, Q, V]."""
        argmax = logits.argmax(dim=-1).tolist() if any(s.sampling_params.greedy for s in seqs) else None
        out = []
        for i, (seq, draft) in enumerate(zip(seqs, proposal.tokens)):
            if seq.sampling_params.greedy:
                out.append(accept_greedy(argmax[i][:len(draft) + 1], draft))
            else:
                out.append(self._accept_sampled(seq, draft, proposal.probs[i], logits[i, :len(draft) + 1]))
        return out

    @staticmethod
    def _accept_sampled(seq: Sequence, draft: list[int], q: Optional[torch.Tensor], logits: torch.Tensor) -> list[int]:
        dev = logits.device
        p = sampling_probs(logits, [seq.sampling_params] * logits.shape[0])
        gen = request_generator(seq, dev)
        uniforms = torch.rand(1, len(draft), generator=gen, device=dev)
        drafts = torch.tensor([draft], dtype=torch.long, device=dev).view(1, len(draft))
        count, token = rejection_sample(p[None], None if q is None else q[None].to(dev), drafts,
                                        torch.tensor([len(draft)], device=dev), uniforms, gen)
        n = int(count[0])
        return draft[:n] + [int(token[0])]
