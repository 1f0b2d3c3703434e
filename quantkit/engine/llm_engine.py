"""LLMEngine: requests in, tokens out, one scheduled step at a time.

    engine = LLMEngine(model, tokenizer, kv_cache_dtype="int8")
    outs = engine.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    engine.get_metrics()   # ttft_ms, tpot_ms, decode_tokens_per_s, kv_blocks_used/total, prefix_hit_rate, ...

``add_request`` + ``step`` drive it incrementally; ``generate`` loops ``step`` until its requests
are done. :meth:`LLMEngine.prompt_logits` / :func:`engine_logits_fn` expose the prefill path for
perplexity, so quality is measured through the same code as speed.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence as Seq, Union

import torch

from quantkit.engine.block_manager import BlockManager
from quantkit.engine.metrics import EngineMetrics
from quantkit.engine.model_runner import ModelRunner
from quantkit.engine.sampler import Sampler
from quantkit.engine.scheduler import Scheduler
from quantkit.engine.sequence import SamplingParams, Sequence
from quantkit.engine.speculative import SpeculativeDecoder, make_proposer
from quantkit.errors import QuantkitError

StreamCallback = Callable[[int, int, str], None]  # (prompt index, token id, newly decodable text)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple, set, frozenset)):
        return [int(t) for t in x]
    return [int(x)]


def eos_token_ids(model, tokenizer=None) -> frozenset:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    ids.update(_as_list(getattr(gen, "eos_token_id", None)))
    ids.update(_as_list(getattr(model.config, "eos_token_id", None)))
    if not ids and tokenizer is not None:
        ids.update(_as_list(getattr(tokenizer, "eos_token_id", None)))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Text deltas for a growing list of tokens, holding back incomplete UTF-8 characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""

    def delta(self, token_ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        if not text.startswith(self.text):  # a merge changed earlier text: emit nothing new
            self.text = text
            return ""
        out, self.text = text[len(self.text):], text
        return out


class LLMEngine:
    def __init__(self, model, tokenizer=None, block_size: int = 16, kv_cache_memory: Union[int, str, None] = None,
                 kv_cache_dtype: Union[str, torch.dtype, None] = "auto", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True,
                 num_kv_blocks: Optional[int] = None, kv_cache_fraction: Optional[float] = None,
                 attention_backend: str = "auto", fuse_projections: Optional[bool] = None, draft=None,
                 num_speculative_tokens: int = 4, draft_tokenizer=None, lm_head_quant: Optional[str] = None,
                 draft_lm_head_quant: Optional[str] = None, draft_confidence: float = 0.0,
                 cuda_graph: Optional[bool] = None, graph_buckets: Optional[Seq[int]] = None):
        """``draft``: speculative decoding (``engine.speculative``) with a draft model (same
        tokenizer: pass ``draft_tokenizer`` to have it checked), ``"ngram"`` (prompt lookup) or a
        proposer object, verifying up to ``num_speculative_tokens`` draft tokens per step; a draft
        model stops early for a sequence once it gives its latest token a probability below
        ``draft_confidence`` (0: always ``num_speculative_tokens``; engine.proposers).
        ``lm_head_quant`` / ``draft_lm_head_quant`` ("int8", "int4", "shortlist"): decode through a quantized
        copy of the target's / draft's LM head only (engine.quantized_head; changes the logits).
        ``cuda_graph``: decode steps from static buffers, replayed from one CUDA graph per batch-size
        bucket (engine.static_step; None: off, as it has not yet run on a GPU; on CPU True runs the same
        static step eagerly); ``graph_buckets``: those batch sizes (default 1, 2, 4, 8, 16, 32, ... up to
        ``max_num_seqs``); a larger batch, and every prefill, runs eagerly."""
        if block_size < 1:
            raise QuantkitError(f"block_size must be at least 1, got {block_size}")
        self.model = model
        self.tokenizer = tokenizer
        runner_kw = dict(attention_backend=attention_backend, fuse_projections=fuse_projections, cuda_graph=cuda_graph)
        self.runner = ModelRunner(model, block_size=block_size, kv_cache_dtype=kv_cache_dtype, num_blocks=num_kv_blocks,
                                  kv_cache_memory=kv_cache_memory, kv_cache_fraction=kv_cache_fraction,
                                  max_num_seqs=max_num_seqs, lm_head_quant=lm_head_quant,
                                  graph_buckets=tuple(graph_buckets) if graph_buckets else None, **runner_kw)
        self.speculative: Optional[SpeculativeDecoder] = None
        if draft is not None:
            proposer = make_proposer(draft, self.runner, num_speculative_tokens, max_num_seqs, tokenizer,
                                     draft_tokenizer, kv_cache_dtype, draft_confidence,
                                     lm_head_quant=draft_lm_head_quant, **runner_kw)
            self.speculative = SpeculativeDecoder(self.runner, proposer, num_speculative_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, eos_token_ids(model, tokenizer),
                                   num_lookahead_tokens=num_speculative_tokens if draft is not None else 0)
        self.sampler = Sampler()
        self.metrics = EngineMetrics()

    # ------------------------------------------------------------------ requests
    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    def encode(self, prompt: Union[str, Seq[int]]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise QuantkitError("text prompts need a tokenizer; pass token ids or give LLMEngine a tokenizer")
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    @property
    def max_model_len(self) -> Optional[int]:
        """The longest sequence (prompt + new tokens) the model was built for: its config's
        max_position_embeddings (None when the config names none)."""
        n = getattr(self.runner.config, "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None

    def add_request(self, prompt: Union[str, Seq[int]], sampling_params: Optional[SamplingParams] = None) -> int:
        """Queue a request; returns its sequence id. It joins the running batch at the next step that has room
        (``step`` returns the Sequence objects, whose ``completion_token_ids`` are the output)."""
        seq = self._make(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def _make(self, prompt, sampling_params) -> Sequence:
        """A validated, not yet queued sequence."""
        seq = Sequence(self.encode(prompt), sampling_params or SamplingParams(), self.block_size)
        vocab = self.runner.embed.num_embeddings
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
            raise QuantkitError(f"prompt token ids must be in [0, {vocab})")
        limit = self.max_model_len
        total = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        if limit is not None and total > limit:  # as vLLM refuses a request longer than max_model_len
            raise QuantkitError(f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.sampling_params.max_tokens}) "
                                f"= {total} exceeds the model's context of {limit} tokens (max_position_embeddings); "
                                "shorten the prompt or lower max_tokens (--max-new-tokens)")
        window = self.runner.sliding_window
        if window and seq.num_prompt_tokens + seq.sampling_params.max_tokens > window:
            raise QuantkitError(f"this model uses sliding-window attention ({window} tokens), which the engine does "
                                "not implement; keep prompt + new tokens within the window")
        self.scheduler.check(seq)
        return seq

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> list[tuple[Sequence, int]]:
        """Run one scheduled prefill or decode step; returns (sequence, new token) for each token it
        appended (one per sequence, or several after a speculative decode step)."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        if self.speculative is not None and not is_prefill:
            return self._speculative_step(seqs)
        computed = [len(s) - s.prefill_start for s in seqs] if is_prefill else None
        t0 = time.perf_counter()
        logits = self.runner.run(seqs, is_prefill)
        token_ids = self.sampler(logits, seqs)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        now = time.perf_counter()
        m = self.metrics
        if is_prefill:
            m.prefill_steps += 1
            m.prefill_time_s += now - t0
            m.prompt_tokens += sum(len(s) for s in seqs)
            m.computed_prompt_tokens += sum(computed)
        else:
            m.decode_steps += 1
            m.decode_time_s += now - t0
            m.decode_tokens += len(seqs)
        m.output_tokens += len(seqs)
        for seq in self.scheduler.postprocess(seqs, token_ids, now):
            m.record_finished(seq)
        if is_prefill and self.speculative is not None:  # the draft reads the prompts in the prefill step too
            self.speculative.proposer.prefill([s for s in seqs if not s.is_finished])
            m.prefill_time_s += time.perf_counter() - now
        return list(zip(seqs, token_ids))

    def _speculative_step(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Propose, verify, accept (engine.speculative); then give back the slots of rejected draft
        tokens and let the proposer forget what left the batch."""
        out = self.speculative.step(seqs, [self.scheduler.lookahead(s) for s in seqs])
        now = time.perf_counter()
        finished, appended = self.scheduler.postprocess_many(seqs, out.tokens, now)
        done = {s.seq_id for s in finished}
        for seq in seqs:
            if seq.seq_id not in done:
                self.block_manager.rollback(seq)
        proposer = self.speculative.proposer
        proposer.accepted(seqs, out.accepted)
        proposer.retain({s.seq_id for s in self.scheduler.running})
        self.metrics.record_speculative(out, sum(map(len, appended)))
        for seq in finished:
            self.metrics.record_finished(seq)
        return [(seq, tok) for seq, toks in zip(seqs, appended) for tok in toks]

    def generate(self, prompts: Seq[Union[str, Seq[int]]],
                 sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None,
                 stream_callback: Optional[StreamCallback] = None) -> list[dict]:
        """Run ``prompts`` together with continuous batching; one dict(text, token_ids, finish_reason) per prompt."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            raise QuantkitError("generate takes a list of prompts (strings or token-id lists)")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise QuantkitError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = {}
        for p, sp in zip(prompts, params):  # validate all before queueing any
            seq = self._make(p, sp)
            seqs[seq.seq_id] = seq
        for seq in seqs.values():
            self.scheduler.add(seq)
        ids = list(seqs)
        index = {sid: i for i, sid in enumerate(ids)}
        detok = {sid: IncrementalDetokenizer(self.tokenizer) for sid in ids} if stream_callback else {}
        pending = set(ids)
        while pending:
            if self.scheduler.is_finished():
                raise RuntimeError("engine went idle with requests unfinished")
            for seq, tok in self.step():
                sid = seq.seq_id
                if sid not in index:
                    continue
                if stream_callback is not None:
                    stream_callback(index[sid], tok, detok[sid].delta(seq.completion_token_ids, final=seq.is_finished))
                if seq.is_finished:
                    pending.discard(sid)
        results = []
        for sid in ids:
            seq = seqs[sid]
            toks = seq.completion_token_ids
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else None
            results.append({"text": text, "token_ids": toks, "finish_reason": seq.finish_reason,
                            "num_prompt_tokens": seq.num_prompt_tokens, "num_preemptions": seq.num_preemptions})
        return results

    # ------------------------------------------------------------------ metrics
    def get_metrics(self) -> dict:
        return self.metrics.summary(self.block_manager, self.runner.kv_cache, self.scheduler.num_preemptions,
                                    speculative=self.speculative is not None)

    def reset_metrics(self) -> None:
        self.metrics = EngineMetrics()
        self.block_manager.reset_counters()
        self.scheduler.num_preemptions = 0

    # ------------------------------------------------------------------ perplexity
    def prompt_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of each row of ``input_ids`` [B, T] -> [B, T, V], computed by
        the engine's prefill path (K/V written to and read from the paged pool), prefix cache off.
        Rows run together as far as free blocks allow."""
        if input_ids.dim() != 2:
            raise QuantkitError("prompt_logits takes input_ids of shape [batch, seq_len]")
        B, T = input_ids.shape
        per_row = -(-T // self.block_size)
        if per_row > self.block_manager.num_free_blocks:
            raise QuantkitError(f"a window of {T} tokens needs {per_row} KV blocks, {self.block_manager.num_free_blocks} "
                                "are free")
        rows = input_ids.tolist()
        out = []
        i = 0
        while i < B:
            n = max(1, min(B - i, self.block_manager.num_free_blocks // per_row,
                           max(1, self.scheduler.max_num_batched_tokens // T)))
            seqs = [Sequence(r, SamplingParams(max_tokens=1), self.block_size) for r in rows[i:i + n]]
            try:
                for s in seqs:
                    self.block_manager.allocate(s, use_prefix_cache=False)
                out.extend(self.runner.run_all_logits(seqs))
            finally:
                for s in seqs:
                    if s.block_table:
                        self.block_manager.deallocate(s)
            i += n
        return torch.stack(out).to(input_ids.device) if out else torch.empty(0)


def engine_logits_fn(engine_or_model, **engine_kwargs) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn(input_ids [B, T]) -> logits [B, T, V]`` through the engine's prefill path, for
    ``quantkit.scoring.perplexity(model, tokens, logits_fn=fn)``. Given a model instead of an
    engine, an engine with just enough KV blocks for the first batch is built on the first call."""
    if isinstance(engine_or_model, LLMEngine):
        return engine_or_model.prompt_logits
    model = engine_or_model
    state: dict = {}

    def fn(input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        need = B * math.ceil(T / engine_kwargs.get("block_size", 16))
        eng = state.get("engine")
        if eng is None or eng.block_manager.num_blocks < need:
            kw = {"enable_prefix_caching": False, "max_num_batched_tokens": max(B * T, 8192), **engine_kwargs}
            kw.setdefault("num_kv_blocks", need)
            eng = state["engine"] = LLMEngine(model, None, **kw)
        return eng.prompt_logits(input_ids)

    fn.engine_state = state
    return fn
