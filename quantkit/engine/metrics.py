"""What the engine measures: per-request latency, decode throughput, KV use, prefix-cache hits."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    ttft_s: list = field(default_factory=list)  # per finished request: arrival -> first token
    tpot_s: list = field(default_factory=list)  # per finished request with > 1 token: mean time per later token
    output_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens of the prefilled sequences (recomputations included)
    computed_prompt_tokens: int = 0  # of those, the ones actually run (prefix-cache hits skipped)
    prefill_steps: int = 0
    prefill_time_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_time_s: float = 0.0

    def record_finished(self, seq) -> None:
        self.ttft_s.append(seq.first_token_time - seq.arrival_time)
        n = seq.num_completion_tokens
        if n > 1:
            self.tpot_s.append((seq.finish_time - seq.first_token_time) / (n - 1))

    def summary(self, block_manager, kv_cache, num_preemptions: int) -> dict:
        def mean_ms(xs):
            return round(1000.0 * sum(xs) / len(xs), 3) if xs else None

        q, h = block_manager.prefix_queried_blocks, block_manager.prefix_hit_blocks
        total = block_manager.num_blocks
        return {
            "requests": len(self.ttft_s),
            "ttft_ms": mean_ms(self.ttft_s),
            "ttft_ms_per_request": [round(1000.0 * t, 3) for t in self.ttft_s],
            "tpot_ms": mean_ms(self.tpot_s),
            "decode_tokens_per_s": round(self.decode_tokens / self.decode_time_s, 2) if self.decode_time_s else None,
            "prefill_tokens_per_s": (round(self.computed_prompt_tokens / self.prefill_time_s, 2)
                                     if self.prefill_time_s else None),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "kv_blocks_used": block_manager.peak_used,
            "kv_blocks_total": total,
            "kv_utilization": round(block_manager.peak_used / total, 4),
            "prefix_hit_blocks": h,
            "prefix_queried_blocks": q,
            "prefix_hit_rate": round(h / q, 4) if q else 0.0,
            "num_preemptions": num_preemptions,
            "kv_cache_dtype": kv_cache.name,
            "kv_bytes_per_block": kv_cache.bytes_per_block,
            "block_size": kv_cache.block_size,
        }
