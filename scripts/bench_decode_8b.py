#!/usr/bin/env python
"""Batch-1 decode speed of a Llama-3-8B-shaped model with random weights: quantkit's engine on an
int4 (RTN, w4g128 sym) copy against transformers' own ``generate`` in fp16. Issue #7's GPU target
(engine int4 at least 2.5x transformers fp16) is measured by this script; it needs ~20 GB of GPU
memory and a few minutes, most of it building the random model.

Rows, each one timed run after a warm-up, same random prompt and length (EOS ignored):

* transformers ``generate`` fp16 (greedy),
* the engine on the same fp16 model (separates the engine's own overhead from the kernel's),
* the engine after every decoder linear is replaced in place by a ``QuantLinear`` holding its RTN
  int4 weight (``gptq`` layout, backend ``auto``: the Triton dequant-GEMM on GPU).

Decode tokens/s excludes the prefill, as in ``scripts/bench_decode.py`` (whose timing functions
this uses). ``--shape tiny`` runs the same steps on a small config (what the test suite does on
CPU, so the script cannot rot between GPU sessions).

    python scripts/bench_decode_8b.py                      # cuda, Llama-3-8B shape
    python scripts/bench_decode_8b.py --layers 8 --json out.json
    python scripts/bench_decode_8b.py --shape tiny --device cpu
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {
    # meta-llama/Meta-Llama-3-8B's config.json
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, rope_theta=500000.0,
                 rms_norm_eps=1e-5),
}
PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


def build_model(shape: str, layers, device, dtype):
    """A LlamaForCausalLM of `shape` with transformers' own random init, built directly on `device`
    in `dtype` (no fp32 copy of 8B parameters)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    config = LlamaConfig(**kw, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def quantize_in_place(model, group_size: int, backend: str) -> int:
    """Every decoder projection becomes a QuantLinear with its RTN int4 weight; returns how many."""
    import torch

    from quantkit.quantizers.grid import rtn_quantize
    from quantkit.runtime.quant_linear import QuantLinear

    n = 0
    for layer in model.model.layers:
        for parent_name, names in PROJECTIONS:
            parent = getattr(layer, parent_name)
            for name in names:
                lin = getattr(parent, name)
                qw = rtn_quantize(lin.weight.data.float(), 4, group_size, True, lin.bias)
                module = QuantLinear.from_quantized(qw, "gptq", dtype=lin.weight.dtype, backend=backend)
                setattr(parent, name, module.to(lin.weight.device))
                del lin, qw
                n += 1
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--backend", default=None, help="QuantLinear backend (default: auto on GPU, cpu on CPU)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    import torch

    from bench_decode import engine_decode, hf_decode
    from quantkit.engine import LLMEngine

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    dtype = torch.float16 if gpu else torch.float32  # fp16 matmuls on CPU are slow and not what is measured
    P, N = args.prompt_len, args.new_tokens
    t0 = time.perf_counter()
    model = build_model(args.shape, args.layers, device, dtype)
    cfg = model.config
    print(f"[bench] built {args.shape} ({cfg.num_hidden_layers} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters, {dtype}) on {device} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    prompt = torch.randint(0, cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = -(-(P + N) // 16) + 4

    def engine_row():
        engine = LLMEngine(model, None, num_kv_blocks=blocks, max_num_seqs=1)
        try:
            return engine_decode(engine, prompt, N)
        finally:
            del engine

    rows = {}
    rows[f"transformers generate {str(dtype).replace('torch.', '')}"] = hf_decode(model, prompt, N)
    rows[f"engine {str(dtype).replace('torch.', '')} (unquantized)"] = engine_row()
    backend = args.backend or ("auto" if gpu else "cpu")
    t0 = time.perf_counter()
    n = quantize_in_place(model, args.group_size, backend)
    print(f"[bench] RTN int4 w4g{args.group_size} sym: {n} linears replaced in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    rows[f"engine int4 rtn (backend {backend})"] = engine_row()
    if gpu:
        rows["peak GPU memory GiB"] = {"value": torch.cuda.max_memory_allocated(device) / 2 ** 30}

    base = next(iter(rows.values()))["decode_tokens_per_s"]
    print(f"\n{args.shape} ({cfg.num_hidden_layers} layers), random weights, device {device}, prompt {P} tokens, "
          f"{N} new tokens, batch 1, one run each")
    print(f"{'':44s} {'decode tok/s':>12s} {'vs transformers':>16s}")
    for name, r in rows.items():
        if "decode_tokens_per_s" in r:
            d = r["decode_tokens_per_s"]
            print(f"{name:44s} {d:12.1f} {d / base:15.2f}x")
        else:
            print(f"{name:44s} {r['value']:12.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "layers": cfg.num_hidden_layers,
                                               "device": str(device), "prompt_len": P, "new_tokens": N,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
