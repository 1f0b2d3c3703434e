"""Models for the MoE scripts (bench_moe.py, moe_calibration_policy.py): written to a folder with the
demo tokenizer, so quantkit and the peer calibrate on real text tokens.

- `random_qwen3_moe`: a random Qwen3-MoE-shaped model (every layer sparse, norm_topk_prob).
- `upcycled_mixtral`: the demo SmolLM2-135M-Instruct (a trained Llama) turned into a Mixtral by
  "sparse upcycling": every layer's MLP copied into each expert with a small independent
  perturbation, and a random router. Mixtral renormalises its top-k weights, so the model computes
  nearly what the trained dense model computes (a trained-ish MoE, its perplexity near SmolLM2's),
  while each expert is calibrated on its own routed tokens.
"""
from __future__ import annotations

from pathlib import Path


def _save(model, folder: Path, tokenizer_from: Path) -> Path:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
    return folder


def random_qwen3_moe(folder: Path, *, tokenizer_from: Path, layers: int = 8, experts: int = 16, top_k: int = 2,
                     hidden: int = 512, moe_intermediate: int = 256, heads: int = 8, kv_heads: int = 4,
                     router_std: float = 0.1, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      head_dim=hidden // heads, moe_intermediate_size=moe_intermediate,
                                      intermediate_size=4 * moe_intermediate, num_experts=experts,
                                      num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=2048,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, router_std)  # the 0.02 init routes by near-ties
    return _save(model, Path(folder), tokenizer_from)


def upcycled_mixtral(folder: Path, *, dense: Path, experts: int = 8, top_k: int = 2, noise: float = 0.05,
                     router_std: float = 0.1, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    src = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    c = src.config
    cfg = transformers.MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                                     num_attention_heads=c.num_attention_heads,
                                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                     max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                                     rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
                                     num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None,
                                     bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    moe = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = {k: v for k, v in src.state_dict().items() if ".mlp." not in k}
    missing = set(moe.load_state_dict(state, strict=False).missing_keys)
    with torch.no_grad():
        for layer, dense_layer in zip(moe.model.layers, src.model.layers):
            mlp = dense_layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            for e in range(experts):
                layer.mlp.experts.gate_up_proj[e] = gate_up * (1 + noise * torch.randn_like(gate_up))
                layer.mlp.experts.down_proj[e] = mlp.down_proj.weight * (1 + noise * torch.randn_like(mlp.down_proj.weight))
            layer.mlp.gate.weight.normal_(0.0, router_std)
    expected = {k for k in missing if ".mlp." in k} | ({"lm_head.weight"} if c.tie_word_embeddings else set())
    assert missing <= expected, sorted(missing - expected)[:3]
    return _save(moe.to(torch.bfloat16), Path(folder), dense)  # the demo model's own storage dtype
