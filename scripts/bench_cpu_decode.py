#!/usr/bin/env python
"""Batch-1 decode tokens/s on CPU: the int4 checkpoint (quantkit `cpu` backend) against the original
model in fp32 and bf16, all through transformers' own `generate`, same prompt and length, one run.

    python scripts/bench_cpu_decode.py [--checkpoint DIR] [--new-tokens 64] [--threads N]

Without --checkpoint it first writes an RTN w4 checkpoint of the demo model into a temp folder.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def decode_rate(model, ids: torch.Tensor, new_tokens: int) -> float:
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
        prefill = time.perf_counter() - t0
    return (new_tokens - 1) / max(total - prefill, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", default="The history of the printing press begins")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import quantkit
    from quantkit.runtime.loader import load_tokenizer

    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = tempfile.mkdtemp(prefix="qk-int4-") + "/rtn-w4"
        quantkit.quantize("demo", "rtn", bits=4, output=ckpt, progress=False)
    tok = load_tokenizer("demo")
    ids = tok(args.prompt, return_tensors="pt").input_ids
    rows = {}
    for label, loader in [
        ("transformers fp32", lambda: quantkit.load("demo", dtype="float32")),
        ("transformers bf16", lambda: quantkit.load("demo", dtype="bfloat16")),
        ("quantkit int4 cpu backend (fp32 activations)", lambda: quantkit.load(ckpt, backend="cpu", dtype="float32")),
        ("quantkit int4 cpu backend (bf16 activations)", lambda: quantkit.load(ckpt, backend="cpu", dtype="bfloat16")),
    ]:
        rows[label] = decode_rate(loader(), ids, args.new_tokens)
    base = rows["transformers fp32"]
    print(f"batch-1 decode, {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    for label, rate in rows.items():
        print(f"{label:48} {rate:8.2f} tok/s   {rate / base:5.2f}x fp32   {rate / rows['transformers bf16']:5.2f}x bf16")
    print(json.dumps({k: round(v, 3) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
