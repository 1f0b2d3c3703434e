"""Tiny random models of every family the engine runs, and helpers shared by the engine tests.

Random init leaves small logit margins, so greedy tokens from these models are a sensitive check:
an engine that computes anything differently from transformers flips them quickly."""
from __future__ import annotations

import torch
import transformers

from quantkit.engine import LLMEngine, SamplingParams, engine_logits_fn
from quantkit.engine.sampler import Sampler

VOCAB = 256


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "opt")


def tiny_model(kind: str = "llama", **extra):
    """A 2-layer random model of `kind` (one of FAMILIES), GQA where the family has it, with the
    parts that distinguish the family made to matter (biases, q/k norms, norm weights)."""
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=None, pad_token_id=0, initializer_range=0.1)
    if kind == "opt":  # no GQA, learned positions, LayerNorm with biases, ReLU MLP
        common = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                      max_position_embeddings=512, word_embed_proj_dim=64, bos_token_id=1, eos_token_id=None,
                      pad_token_id=0, init_std=0.1)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "phi3": transformers.Phi3Config, "opt": transformers.OPTConfig}[kind]
    if kind == "qwen3":
        common["head_dim"] = 24  # != hidden / heads, like real Qwen3
    cfg = cls(**{**common, **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if kind in ("phi3", "opt"):  # norm weights (and OPT's biases) away from their init, so they matter
        for name, param in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(param, 1.0 if name.endswith("weight") else 0.0, 0.3)
            elif kind == "opt" and name.endswith("bias"):
                torch.nn.init.normal_(param, 0.0, 0.2)
    if kind == "qwen2":  # random biases, so they matter
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(lin.bias, std=0.5)
    if kind == "qwen3":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_norm.weight, 1.0, 0.3)
    return model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def prompts(n, lengths, vocab=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths][:n]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def assert_pool_full(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert engine.is_finished()


class ForcingSampler(Sampler):
    """Feeds given tokens instead of sampling and records the logits (teacher forcing through decode)."""

    def __init__(self, forced: list[int]):
        self.forced, self.logits = forced, []

    def __call__(self, logits, seqs):
        self.logits.append(logits[0].float().clone())
        return [self.forced[len(self.logits) - 1]]


def assert_engine_logits(model, x: torch.Tensor, want: torch.Tensor, prefill_block_size: int = 4, row: int = 0,
                         prefix: int = 8) -> LLMEngine:
    """The engine's prefill logits of `x` [B, T] at every position, then its decode logits along row
    `row` teacher-forced after its first `prefix` tokens (K/V read back from the paged cache), equal
    `want` (an independent forward's logits of `x`) within 1e-4; the pool ends full. Returns the
    decoding engine."""
    torch.testing.assert_close(engine_logits_fn(model, block_size=prefill_block_size)(x), want, atol=1e-4, rtol=1e-4)
    eng = LLMEngine(model, block_size=4, num_kv_blocks=12)
    forced = x[row, prefix:].tolist()
    eng.sampler = ForcingSampler(forced)
    eng.generate([x[row, :prefix].tolist()], greedy(len(forced), ignore_eos=True))
    torch.testing.assert_close(torch.stack(eng.sampler.logits), want[row, prefix - 1:-1], atol=1e-4, rtol=1e-4)
    assert_pool_full(eng)
    return eng


def with_rtn_quantlinears(model, group_size: int = 32, sym: bool = True, backend: str = "auto"):
    """`model` (a Llama-style tiny model, changed in place) with each decoder layer's attention and MLP
    linears replaced by their 4-bit RTN `QuantLinear` (gptq layout, fp32 compute) on `backend`."""
    from quantkit.quantizers.grid import rtn_quantize
    from quantkit.runtime.quant_linear import QuantLinear

    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                lin = getattr(parent, n)
                qw = rtn_quantize(lin.weight.data, 4, group_size, sym, lin.bias)
                setattr(parent, n, QuantLinear.from_quantized(qw, "gptq", dtype=torch.float32, backend=backend))
    return model
