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

``--cuda-graph both`` (the default on GPU) runs each engine row twice, eagerly and with its decode
step replayed from a CUDA graph (engine.static_step, issue #49), and prints the ratios the issue
asks for: int4 over fp16 (both from graphs), graph over eager, and each row's weight bytes per
token times its tokens/s against the card's bandwidth (``--peak-gbs``; H200 4800, H100 SXM 3350
assumed from the device name). On CPU ``both`` adds the static-step rows, run eagerly (no graphs
on CPU): what the test suite runs so that the path cannot rot.

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
    ap.add_argument("--cuda-graph", choices=("both", "on", "off"), default=None,
                    help="engine rows eager (off), from CUDA graphs (on) or both (default: both on GPU, off on CPU)")
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="the card's memory bandwidth in GB/s (default: from the device name, H200/H100 only)")
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

    graph_mode = args.cuda_graph or ("both" if gpu else "off")
    graph_label = "CUDA graph" if gpu else "static step, no graph on CPU"

    def engine_rows(name: str) -> None:
        """The engine's row(s) for the model as it is now: eager and/or from CUDA graphs."""
        weight_bytes = bytes_read_per_token(model)
        for graphed in {"off": (False,), "on": (True,), "both": (False, True)}[graph_mode]:
            engine = LLMEngine(model, None, num_kv_blocks=blocks, max_num_seqs=1, cuda_graph=graphed)
            try:
                row = engine_decode(engine, prompt, N, keep_tokens=True)
                row["weight_bytes_per_token"] = weight_bytes
                row["static_step"] = engine.runner.static_step is not None
                row["cuda_graphs_captured"] = len(engine.runner.static_step.graphs) if row["static_step"] else 0
            finally:
                del engine
            rows[f"{name} ({graph_label})" if graphed else name] = row

    rows = {}
    dt = str(dtype).replace('torch.', '')
    rows[f"transformers generate {dt}"] = hf_decode(model, prompt, N)
    engine_rows(f"engine {dt} (unquantized)")
    backend = args.backend or ("auto" if gpu else "cpu")
    t0 = time.perf_counter()
    n = quantize_in_place(model, args.group_size, backend)
    print(f"[bench] RTN int4 w4g{args.group_size} sym: {n} linears replaced in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    engine_rows(f"engine int4 rtn (backend {backend})")
    if gpu:
        rows["peak GPU memory GiB"] = {"value": torch.cuda.max_memory_allocated(device) / 2 ** 30}
    peak = args.peak_gbs or (peak_bandwidth_gbs(torch.cuda.get_device_name(device)) if gpu else None)

    base = next(iter(rows.values()))["decode_tokens_per_s"]
    print(f"\n{args.shape} ({cfg.num_hidden_layers} layers), random weights, device {device}, prompt {P} tokens, "
          f"{N} new tokens, batch 1, one run each")
    width = max(map(len, rows)) + 1
    print(f"{'':{width}s} {'decode tok/s':>12s} {'vs transformers':>16s}")
    for name, r in rows.items():
        if "decode_tokens_per_s" in r:
            d = r["decode_tokens_per_s"]
            print(f"{name:{width}s} {d:12.1f} {d / base:15.2f}x")
        else:
            print(f"{name:{width}s} {r['value']:12.1f}")
    print_ratios(rows, dt, backend, graph_label, peak)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "layers": cfg.num_hidden_layers,
                                               "device": str(device), "prompt_len": P, "new_tokens": N,
                                               "cuda_graph": graph_mode, "peak_gbs": peak, "rows": rows}, indent=2))
    return 0


def bytes_read_per_token(model) -> int:
    """Bytes a batch-1 decode step must read: every parameter and buffer (packed int4 words,
    scales, norms, the LM head) except the input embedding table, of which it reads one row."""
    embed = model.get_input_embeddings().weight
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers()) if t.data_ptr() != embed.data_ptr()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


PEAK_GBS = {"H200": 4800.0, "H100": 3350.0}  # HBM3e / HBM3 (SXM) data-sheet figures


def peak_bandwidth_gbs(device_name: str):
    for key, gbs in PEAK_GBS.items():
        if key in device_name:
            return gbs
    return None


def print_ratios(rows: dict, dt: str, backend: str, graph_label: str, peak) -> None:
    """Graph over eager, int4 over the unquantized engine, achieved bandwidth (all from this run)."""
    fp, q4 = f"engine {dt} (unquantized)", f"engine int4 rtn (backend {backend})"
    speed = {name: r["decode_tokens_per_s"] for name, r in rows.items() if "decode_tokens_per_s" in r}
    print("\nratios (decode tok/s, this run):")
    for name in (fp, q4):
        graphed = f"{name} ({graph_label})"
        if name in speed and graphed in speed:
            same = rows[name]["token_ids"] == rows[graphed]["token_ids"]
            print(f"  {graphed} / eager: {speed[graphed] / speed[name]:.2f}x (same greedy tokens: {same})")
    for suffix in ("", f" ({graph_label})"):
        if fp + suffix in speed and q4 + suffix in speed:
            print(f"  int4 / {dt}{suffix}: {speed[q4 + suffix] / speed[fp + suffix]:.2f}x (issue #49 target: 2.5x)")
    for name, r in rows.items():
        if "weight_bytes_per_token" in r:
            gbs = r["weight_bytes_per_token"] * r["decode_tokens_per_s"] / 1e9
            share = f", {100 * gbs / peak:.0f} % of {peak:.0f} GB/s" if peak else ""
            print(f"  {name}: {r['weight_bytes_per_token'] / 1e9:.2f} GB of weights per token, {gbs:.0f} GB/s{share}")


if __name__ == "__main__":
    sys.exit(main())
