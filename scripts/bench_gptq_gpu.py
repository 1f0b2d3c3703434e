#!/usr/bin/env python
"""GPTQ wall time on a GPU: `quantkit.quantize(method="gptq")` (the defaults: act-order, static
groups) on random-weight Llama models of real shapes, side by side on the devices asked for.

Rows, each a whole quantize call (load, calibrate layer by layer, pack, write), on the same model
folder and the same random calibration ids (speed does not depend on the token values):

* ``smollm2-135m`` (the demo's shape, w4g64 as the CPU benches) with ``--small-layers`` layers, on every device in ``--devices``
  (so cuda against the same machine's cpu cores, in one run);
* ``llama3-8b`` (w4g128) with ``--big-layers`` and twice that many layers on cuda: the difference of the two
  runs over the layers added is the measured per-decoder-layer cost at that shape (embedding, head,
  load and write costs cancel). Nothing is extrapolated to the whole model.

The random models are written once to a temporary folder in bf16 with a small word-level
tokenizer (quantize needs one; ids come in as tensors, so it never tokenizes).

    python scripts/bench_gptq_gpu.py                               # cuda and cpu, both shapes
    python scripts/bench_gptq_gpu.py --devices cpu --shapes smollm2-135m --small-layers 2 --num-samples 8
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json (the demo model's shape)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    # meta-llama/Meta-Llama-3-8B's config.json
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
}


def write_random_model(folder: Path, shape: str, layers: int) -> Path:
    """A random LlamaForCausalLM of `shape` and `layers` saved in bf16, with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is fast on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                  unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(folder)
    del model
    return folder


def quantize_once(model_dir: Path, out_dir: Path, ids, device: str, group_size: int) -> dict:
    import torch

    from quantkit import api

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    summary = api.quantize(str(model_dir), "gptq", bits=4, group_size=group_size, dataset=ids, num_samples=ids.shape[0],
                           seq_len=ids.shape[1], device=device,
                           output=out_dir, overwrite=True, progress=False)
    wall = time.perf_counter() - t0
    row = {"seconds": round(wall, 2), "quantized_linears": summary["quantized_linears"],
           "peak_rss_mb": summary["peak_rss_mb"]}
    if device == "cuda":
        row["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cuda,cpu", help="comma list; the small shape runs on each")
    ap.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    ap.add_argument("--small-layers", type=int, default=8, help="decoder layers of the smollm2-135m rows")
    ap.add_argument("--big-layers", type=int, default=2, help="llama3-8b runs with N and 2N layers (cuda only)")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--small-num-samples", type=int, default=64, help="the demo-shape rows (the CPU benches' 64 x 512)")
    ap.add_argument("--small-seq-len", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    devices = [d for d in args.devices.split(",") if d]
    if "cuda" in devices and not torch.cuda.is_available():
        print("bench_gptq_gpu.py: no CUDA device here; pass --devices cpu to time the CPU alone", file=sys.stderr)
        return 2
    shapes = [s for s in args.shapes.split(",") if s]
    rows = []
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="qk-gptq-bench-") as tmp:
        tmp = Path(tmp)
        if "smollm2-135m" in shapes:
            model_dir = write_random_model(tmp / "small", "smollm2-135m", args.small_layers)
            ids = torch.randint(3, 49152, (args.small_num_samples, args.small_seq_len), generator=g)
            for device in devices:
                r = quantize_once(model_dir, tmp / f"small-{device}", ids, device, 64)
                rows.append({"shape": "smollm2-135m", "layers": args.small_layers, "device": device,
                             "tokens": f"{args.small_num_samples}x{args.small_seq_len}", **r})
                print(json.dumps(rows[-1]), flush=True)
        if "llama3-8b" in shapes and "cuda" in devices:
            ids = torch.randint(3, 128256, (args.num_samples, args.seq_len), generator=g)
            timed = {}
            for layers in (args.big_layers, 2 * args.big_layers):
                model_dir = write_random_model(tmp / f"big{layers}", "llama3-8b", layers)
                r = quantize_once(model_dir, tmp / f"big{layers}-out", ids, "cuda", 128)
                timed[layers] = r["seconds"]
                rows.append({"shape": "llama3-8b", "layers": layers, "device": "cuda",
                             "tokens": f"{args.num_samples}x{args.seq_len}", **r})
                print(json.dumps(rows[-1]), flush=True)
                for p in (model_dir, tmp / f"big{layers}-out"):
                    shutil.rmtree(p, ignore_errors=True)
            per_layer = (timed[2 * args.big_layers] - timed[args.big_layers]) / args.big_layers
            rows.append({"shape": "llama3-8b", "device": "cuda", "seconds_per_decoder_layer": round(per_layer, 2)})
            print(json.dumps(rows[-1]), flush=True)

    print()
    print(f"| shape | layers | device | calibration tokens | quantize s | peak RSS MB | peak GPU MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "seconds" in r:
            print(f"| {r['shape']} | {r['layers']} | {r['device']} | {r['tokens']} | {r['seconds']} | "
                  f"{r['peak_rss_mb']} | {r.get('peak_gpu_mb', '-')} |")
    small = {r["device"]: r["seconds"] for r in rows if r.get("shape") == "smollm2-135m" and "seconds" in r}
    if "cuda" in small and "cpu" in small:
        print(f"\nsmollm2-135m x {args.small_layers} layers: cpu / cuda wall = {small['cpu'] / small['cuda']:.2f}x "
              f"(cpu: {torch.get_num_threads()} threads)")
    for r in rows:
        if "seconds_per_decoder_layer" in r:
            print(f"llama3-8b, {args.num_samples}x{args.seq_len} tokens: {r['seconds_per_decoder_layer']} s per decoder "
                  f"layer on cuda (difference of the {args.big_layers}- and {2 * args.big_layers}-layer runs)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
