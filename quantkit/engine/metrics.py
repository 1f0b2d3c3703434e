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
    # speculative decoding: per sequence and decode step
    spec_steps: int = 0  # sequence-steps verified
    draft_tokens: int = 0  # draft tokens proposed
    accepted_tokens: int = 0  # of those, accepted by the target
    rejected_steps: int = 0  # sequence-steps that ended at a rejected draft token
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def record_finished(self, seq) -> None:
        self.ttft_s.append(seq.first_token_time - seq.arrival_time)
        n = seq.num_completion_tokens
        if n > 1:
            self.tpot_s.append((seq.finish_time - seq.first_token_time) / (n - 1))

    def record_speculative(self, step, appended: int) -> None:
        """One speculative decode step (an engine.speculative.SpeculativeStep) that appended `appended` tokens."""
        self.decode_steps += 1
        self.decode_time_s += step.draft_s + step.verify_s
        self.decode_tokens += appended
        self.output_tokens += appended
        self.spec_steps += len(step.proposed)
        self.draft_tokens += sum(step.proposed)
        self.accepted_tokens += sum(step.accepted)
        self.rejected_steps += sum(a < p for a, p in zip(step.accepted, step.proposed))
        self.draft_time_s += step.draft_s
        self.verify_time_s += step.verify_s

    def speculative_summary(self) -> dict:
        """acceptance_rate: accepted / proposed draft tokens (vLLM's definition); mean_accepted_tokens:
        draft tokens accepted per sequence per step (a step emits one more); per_token_acceptance:
        accepted / (accepted + rejections), the chance that a draft token reached is accepted (the
        alpha of E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha))."""
        trials = self.accepted_tokens + self.rejected_steps
        return {
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else None,
            "mean_accepted_tokens": round(self.accepted_tokens / self.spec_steps, 4) if self.spec_steps else None,
            "per_token_acceptance": round(self.accepted_tokens / trials, 4) if trials else None,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "speculative_steps": self.spec_steps,
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
        }

    def summary(self, block_manager, kv_cache, num_preemptions: int, speculative: bool = False) -> dict:
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
            "decode_time_s": round(self.decode_time_s, 4),
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
            **(self.speculative_summary() if speculative else {}),
        }
