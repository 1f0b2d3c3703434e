"""quantkit.engine: a small paged-KV inference engine (after nano-vllm) for quantkit models.

* :mod:`.sequence` - requests and :class:`SamplingParams`
* :mod:`.block_manager` - the KV block pool: free list, reference counts, prefix caching
* :mod:`.scheduler` - continuous batching, prefill/decode steps, preemption by recomputation
* :mod:`.kv_cache` - the pool tensors in the model dtype, int8 or fp8 (per-token-head scales)
* :mod:`.rotary`, :mod:`.sampler` - rotary embeddings from the config; greedy/temperature/top-k/top-p
* :mod:`.decoder` - the model as plain callables, built from its family's adapter (``quantkit.models``):
  Llama, Mistral, Qwen2, Qwen3, Phi-3, OPT
* :mod:`.model_runner` - the forward over paged KV: prefill, decode (Triton kernel on GPU), extend
* :mod:`.speculative`, :mod:`.proposers`, :mod:`.rejection_sampler` - speculative decoding: a draft
  model or n-gram lookup proposes, the target verifies k tokens per step, rejection sampling keeps its
  distribution
* :mod:`.llm_engine` - :class:`LLMEngine` (``generate``, ``add_request``/``step``, metrics) and
  :func:`engine_logits_fn` for perplexity through the engine
* :mod:`.api` - :func:`generate_text` and :func:`run_bench`, called by the CLI
"""
from quantkit.engine.api import generate_text, run_bench
from quantkit.engine.block_manager import BlockManager
from quantkit.engine.kv_cache import KVCache
from quantkit.engine.llm_engine import LLMEngine, engine_logits_fn
from quantkit.engine.model_runner import ModelRunner
from quantkit.engine.rotary import RotaryEmbedding
from quantkit.engine.sampler import Sampler
from quantkit.engine.scheduler import Scheduler
from quantkit.engine.sequence import SamplingParams, Sequence

__all__ = ["LLMEngine", "SamplingParams", "Sequence", "BlockManager", "Scheduler", "KVCache", "ModelRunner",
           "RotaryEmbedding", "Sampler", "engine_logits_fn", "generate_text", "run_bench"]
