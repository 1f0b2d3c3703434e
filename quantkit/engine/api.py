"""What the CLI calls: one-prompt generation with streaming, and an engine benchmark."""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Union

import torch

from quantkit.engine.llm_engine import LLMEngine
from quantkit.engine.sequence import SamplingParams
from quantkit.errors import QuantkitError
from quantkit.option_values import at_least


def load_model_and_tokenizer(model_path: str, backend: str = "auto", device: Optional[str] = None,
                             dtype: Optional[str] = None):
    """``quantkit.load`` (quantized checkpoint, plain HF folder or "demo") and its tokenizer."""
    import quantkit
    from quantkit.runtime.loader import load_tokenizer

    model = quantkit.load(str(model_path), backend=backend, device=device, dtype=dtype)
    return model, load_tokenizer(str(model_path))


def load_draft(draft, model_path: str, backend: str = "auto", device: Optional[str] = None,
               dtype: Optional[str] = None) -> tuple[object, object]:
    """(draft, its tokenizer) for ``LLMEngine(draft=...)``: ``"ngram"`` as it is, a path (or "demo")
    loaded like the target; a draft equal to the target path is refused (it would accept every
    token and only add its own cost)."""
    if draft is None or (isinstance(draft, str) and draft.strip().lower() == "ngram"):
        return draft, None
    if not isinstance(draft, str):
        return draft, None  # a loaded model or a proposer object
    if draft == str(model_path):
        raise QuantkitError("the draft is the target model itself; pass a smaller or quantized model, or ngram")
    return load_model_and_tokenizer(draft, backend, device, dtype)


SPECULATIVE_KEYS = ("acceptance_rate", "mean_accepted_tokens", "per_token_acceptance", "draft_tokens",
                    "accepted_tokens", "speculative_steps")


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise QuantkitError("this model's tokenizer has no chat template; drop --chat")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def generate_text(model_path: str, prompt: str, max_new_tokens: int = 64, chat: bool = False,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                  stream: Optional[Callable[[str], None]] = None, backend: str = "auto",
                  kv_cache_dtype: str = "auto", block_size: int = 16,
                  kv_cache_memory: Union[int, str, None] = None, device: Optional[str] = None,
                  dtype: Optional[str] = None, ignore_eos: bool = False, draft=None, num_speculative_tokens: int = 4,
                  draft_dtype: Optional[str] = None, lm_head_quant: Optional[str] = None,
                  draft_lm_head_quant: Optional[str] = None, draft_confidence: float = 0.0,
                  cuda_graph: Optional[bool] = None) -> dict:
    """Generate from one prompt through the engine. ``stream(text_piece)`` is called as text becomes
    decodable (e.g. ``functools.partial(print, end="", flush=True)``). Returns dict(text, token_ids,
    finish_reason, num_prompt_tokens, ttft_ms, tpot_ms, tokens_per_s), and with a ``draft`` (a model
    path, "demo", "ngram" or a loaded model: speculative decoding, ``num_speculative_tokens`` per
    step) acceptance_rate, mean_accepted_tokens and the counts behind them. ``lm_head_quant`` /
    ``draft_lm_head_quant``, ``draft_confidence``, ``cuda_graph``: see :class:`LLMEngine`."""
    at_least("--block-size", block_size)
    model, tokenizer = load_model_and_tokenizer(model_path, backend, device, dtype)
    draft, draft_tokenizer = load_draft(draft, model_path, backend, device, draft_dtype)
    ids = encode_prompt(tokenizer, prompt, chat)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens, seed=seed,
                            ignore_eos=ignore_eos)
    kw = {}
    if kv_cache_memory is None:  # one request: a pool of exactly its size
        kw["num_kv_blocks"] = math.ceil((len(ids) + max_new_tokens) / block_size)
    engine = LLMEngine(model, tokenizer, block_size=block_size, kv_cache_memory=kv_cache_memory,
                       kv_cache_dtype=kv_cache_dtype, max_num_seqs=1, draft=draft,
                       num_speculative_tokens=num_speculative_tokens, draft_tokenizer=draft_tokenizer,
                       lm_head_quant=lm_head_quant, draft_lm_head_quant=draft_lm_head_quant,
                       draft_confidence=draft_confidence, cuda_graph=cuda_graph, **kw)
    callback = (lambda _i, _tok, piece: stream(piece) if piece else None) if stream is not None else None
    t0 = time.perf_counter()
    out = engine.generate([ids], params, stream_callback=callback)[0]
    wall = time.perf_counter() - t0
    m = engine.get_metrics()
    return {"text": out["text"], "token_ids": out["token_ids"], "finish_reason": out["finish_reason"],
            "num_prompt_tokens": len(ids), "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"],
            "tokens_per_s": round(len(out["token_ids"]) / wall, 2) if wall > 0 else None,
            "kv_cache_dtype": m["kv_cache_dtype"], **{k: m[k] for k in SPECULATIVE_KEYS if k in m}}


def random_prompts(vocab_size: int, batch: int, input_len: int, seed: int = 0, low: int = 100) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = min(low, max(0, vocab_size - 1))
    return torch.randint(low, vocab_size, (batch, input_len), generator=g).tolist()


def run_bench(model_path: str = "demo", batch: int = 8, input_len: int = 128, output_len: int = 128,
              kv_cache_dtype: str = "auto", block_size: int = 16, kv_cache_memory: Union[int, str, None] = None,
              backend: str = "auto", device: Optional[str] = None, dtype: Optional[str] = None,
              max_num_seqs: Optional[int] = None, seed: int = 0, warmup: bool = True, model=None,
              tokenizer=None, draft=None, num_speculative_tokens: int = 4, draft_dtype: Optional[str] = None,
              draft_tokenizer=None, lm_head_quant: Optional[str] = None,
              draft_lm_head_quant: Optional[str] = None, draft_confidence: float = 0.0,
              cuda_graph: Optional[bool] = None) -> dict:
    """``batch`` random prompts of ``input_len`` tokens, ``output_len`` greedy tokens each (EOS
    ignored), all submitted at once and run with continuous batching.

    Returns ttft_ms / tpot_ms (means over requests), tokens_per_s (all output tokens / wall time),
    decode_tokens_per_s (decode steps only), kv_blocks_used (peak) / kv_blocks_total /
    kv_utilization, prefix_hit_rate, kv_bytes_per_block, num_preemptions, wall_s, ... . Pass
    ``model`` (and ``tokenizer``) to reuse a loaded model instead of loading ``model_path``. With a
    ``draft`` (as for :func:`generate_text`) it decodes speculatively and adds acceptance_rate,
    mean_accepted_tokens and the counts behind them (random prompts: a draft accepts less than
    on real text). ``cuda_graph``: see :class:`LLMEngine`."""
    if batch < 1 or input_len < 1 or output_len < 1:
        raise QuantkitError("batch, input_len and output_len must be at least 1")
    at_least("--block-size", block_size)
    if model is None:
        model, tokenizer = load_model_and_tokenizer(model_path, backend, device, dtype)
    if draft_tokenizer is None:
        draft, draft_tokenizer = load_draft(draft, model_path, backend, device, draft_dtype)
    engine = LLMEngine(model, tokenizer, block_size=block_size, kv_cache_memory=kv_cache_memory,
                       kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs or batch,
                       max_num_batched_tokens=max(8192, input_len), draft=draft,
                       num_speculative_tokens=num_speculative_tokens, draft_tokenizer=draft_tokenizer,
                       lm_head_quant=lm_head_quant, draft_lm_head_quant=draft_lm_head_quant,
                       draft_confidence=draft_confidence, cuda_graph=cuda_graph)
    vocab = engine.runner.embed.num_embeddings
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if warmup:
        engine.generate(random_prompts(vocab, 1, min(input_len, 16), seed + 1), SamplingParams(
            temperature=0.0, max_tokens=2, ignore_eos=True))
        engine.reset_metrics()
    prompts = random_prompts(vocab, batch, input_len, seed)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    m = engine.get_metrics()
    m.pop("ttft_ms_per_request", None)
    produced = sum(len(o["token_ids"]) for o in outs)
    return {"model": str(model_path), "batch": batch, "input_len": input_len, "output_len": output_len,
            "backend": backend, "device": str(engine.runner.device), "dtype": str(engine.runner.dtype).replace("torch.", ""),
            "wall_s": round(wall, 3), "tokens_per_s": round(produced / wall, 2), **m}
