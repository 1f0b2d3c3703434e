#!/usr/bin/env python
"""Streaming against whole-model quantization: peak RSS and wall time, from one run.

Generates a random-weight Llama-architecture model on disk (fp32, sharded safetensors, the demo's
tokenizer), written one layer at a time so this script itself never holds the model, then
quantizes it twice through the real CLI, each in its own subprocess (so `peak_rss_mb`, from the
child's own VmHWM, is that run's alone): once with `--streaming` (decoder layers read from disk one at a
time) and once with `--no-streaming` (the whole model in memory). Both must write identical bytes.

    python scripts/bench_streaming.py                      # ~2.9 GB fp32 model, RTN w4g64
    python scripts/bench_streaming.py --layers 20 --json   # smaller
    python scripts/bench_streaming.py --moe-experts 16 --layers 12   # a random Qwen3-MoE (per-expert tensors)

The tests (tests/test_robustness.py) import `make_random_llama` and `quantize_cli` from here.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_random_llama(folder: Path, *, layers: int = 40, hidden: int = 1024, intermediate: int = 4096, heads: int = 16,
                      kv_heads: int = 16, vocab: int = 49152, layers_per_shard: int = 4, seed: int = 0,
                      tokenizer_from: Path | None = None) -> int:
    """Write a random fp32 Llama folder (config, shards + index, tokenizer); return the weight bytes.

    Memory stays at about one shard: each shard's tensors are generated, saved and dropped."""
    import torch
    import transformers
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                   max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                                   eos_token_id=2, dtype="float32")
    cfg.save_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    def layer_tensors(i: int) -> dict:
        p = f"model.layers.{i}."
        return {
            p + "input_layernorm.weight": torch.ones(hidden) + randn(hidden, std=0.01),
            p + "post_attention_layernorm.weight": torch.ones(hidden) + randn(hidden, std=0.01),
            p + "self_attn.q_proj.weight": randn(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": randn(intermediate, hidden),
            p + "mlp.up_proj.weight": randn(intermediate, hidden),
            p + "mlp.down_proj.weight": randn(hidden, intermediate),
        }

    groups = [list(range(s, min(s + layers_per_shard, layers))) for s in range(0, layers, layers_per_shard)]
    n_shards = len(groups) + 1
    weight_map, total = {}, 0
    for shard, idx in enumerate([None, *groups]):
        tensors = ({"model.embed_tokens.weight": randn(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
                   if idx is None else {k: v for i in idx for k, v in layer_tensors(i).items()})
        name = f"model-{shard + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({k: name for k in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    if tokenizer_from is not None:
        transformers.AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def quantize_cli(model: Path, output: Path, *args: str, timeout: float = 1800) -> dict:
    """`quantkit quantize --json` in a fresh subprocess; the summary plus `wall_s` (process wall time)."""
    cmd = [sys.executable, "-m", "quantkit.cli", "quantize", "--model", str(model), "--output", str(output), "--json",
           *args]
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"quantize failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["wall_s"] = round(wall, 1)
    summary["cpu_s"] = round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1)
    return summary


def tree_sha256(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[str(p.relative_to(folder))] = h.hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--method", default="rtn")
    ap.add_argument("--moe-experts", type=int, default=0,
                    help="a random Qwen3-MoE with this many experts per layer (moe intermediate = --intermediate / 4, "
                         "top-2), written by scripts/moe_models.py, instead of the dense Llama")
    ap.add_argument("--extra", default="", help="more quantize flags, e.g. '--num-samples 8 --seq-len 128'")
    ap.add_argument("--workdir", default=None, help="where the model and outputs go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the generated model and outputs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from quantkit.assets import demo_model_dir

    own = args.workdir is None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        model = work / "model"
        if args.moe_experts:
            from moe_models import random_qwen3_moe

            random_qwen3_moe(model, tokenizer_from=Path(demo_model_dir()), layers=args.layers,
                             experts=args.moe_experts, hidden=args.hidden, moe_intermediate=args.intermediate // 4,
                             heads=16, kv_heads=4)
            size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        else:
            size = make_random_llama(model, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                                     tokenizer_from=Path(demo_model_dir()))
        gen_s = time.perf_counter() - t0
        rows = {}
        for mode in ("streaming", "no-streaming"):
            out = work / f"out-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            rows[mode] = quantize_cli(model, out, "--method", args.method, f"--{mode}", *args.extra.split())
        same = tree_sha256(work / "out-streaming") == tree_sha256(work / "out-no-streaming")
        result = {"weights_mb": round(size / 2**20, 1), "layers": args.layers, "moe_experts": args.moe_experts,
                  "generate_s": round(gen_s, 1),
                  "method": args.method, "identical_output": same,
                  **{f"{m}_{k}": rows[m][k] for m in rows for k in ("peak_rss_mb", "seconds", "wall_s", "cpu_s")}}
        result["streaming_rss_fraction"] = round(result["streaming_peak_rss_mb"] / result["weights_mb"], 3)
        result["no-streaming_rss_fraction"] = round(result["no-streaming_peak_rss_mb"] / result["weights_mb"], 3)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"model: {args.layers} layers, {result['weights_mb']:.0f} MB fp32 weights (generated in {gen_s:.0f} s)")
            for m in rows:
                print(f"  {m:13s} peak RSS {rows[m]['peak_rss_mb']:8.0f} MB ({result[f'{m}_rss_fraction']:.0%} of weights)"
                      f"  quantize {rows[m]['seconds']:7.1f} s  process {rows[m]['wall_s']:7.1f} s"
                      f" (cpu {rows[m]['cpu_s']:.1f} s)")
            print(f"  outputs byte-identical: {same}")
    finally:
        if not args.keep:  # only what this script made
            for p in [work / "model", work / "out-streaming", work / "out-no-streaming"] + ([work] if own else []):
                shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    main()
