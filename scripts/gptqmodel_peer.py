#!/usr/bin/env python
"""Run GPTQModel's GPTQ or AWQ on the same model, scheme and calibration tokens as quantkit.

Why this exists: quantkit's quality benchmark compares it with its peers on identical calibration
tokens. This script is GPTQModel's side of that comparison and nothing more: it runs under a
separate venv where `gptqmodel` is installed (e.g. /work/gptqmodel-venv/bin/python), never imports
the quantkit package (only quantkit/memory.py, stdlib-only, loaded by path so every tool measures
peak RSS alike), and GPTQModel is never a dependency of quantkit. The calibration token ids come
from a safetensors file written with quantkit's own data pipeline (key "input_ids", int64
[num_samples, seq_len]), the same file scripts/llmcompressor_peer.py reads.

Methods (GPTQModel's own defaults unless a flag says otherwise; the JSON reports what was saved):
  gptq   GPTQConfig: desc_act False, act_group_aware True ("GAR": group-aware act-order, which
         reorders columns inside each group but keeps g_idx trivial), damp_percent 0.05 (auto
         increment 0.01 on a non-PD Hessian), static_groups False, mse 0.0 (no clip search),
         true_sequential True, format gptq. Symmetric unless --asym.
  awq    AWQConfig, format gemm: duo scaling, 20-point alpha grid, clip search on (20 ratios down to
         0.55, 512 sampled tokens). GPTQModel 7.7's AWQConfig inherits sym=True, i.e. no zero point,
         unless --asym; the saved "zero_point" key says which (read back below).

On CPU GPTQModel loads the model in bfloat16 unless --dtype says otherwise (its auto_dtype);
"model_dtype" in the JSON says which. bfloat16 needs a CPU with native bfloat16 support to be quick: on 2
AMD EPYC cores with AVX2 only (2026-12-05) its AWQ took ~6 min per layer of the demo (3 hours in all),
against 41-58 CPU minutes for all 30 layers on the AVX-512 / AMX machine of docs/benchmarks.md's rows. --dtype
float32 does not help AWQ: GPTQModel 7.7 refuses to pack it (AwqTorchLinear takes float16 / bfloat16 only).
The last stdout line is one JSON object; "seconds" is the quantize() call only, "scheme" is read back from
the saved quantization config.

Creating the venv (CPU only). GPTQModel 7.7.0 declares torch>=2.14.1, which PyPI serves only as a
CUDA build (with ~3 GB of nvidia-* wheels); the code itself imports and runs on the local CPU torch
2.13.0, so its requirements are installed with torch pinned and the package itself without deps:
    python3 -m venv /work/gptqmodel-venv
    /work/gptqmodel-venv/bin/pip install --upgrade pip
    /work/gptqmodel-venv/bin/pip install torch==2.13.0
    pip download --no-deps --no-binary :all: -d /tmp/gm gptqmodel==7.7.0 && tar xzf /tmp/gm/*.tar.gz -C /tmp/gm
    grep -v '^torch>=' /tmp/gm/gptqmodel-7.7.0/requirements.txt > /tmp/gm-req.txt
    /work/gptqmodel-venv/bin/pip install -r /tmp/gm-req.txt -c <(echo torch==2.13.0)
    /work/gptqmodel-venv/bin/pip install --no-deps gptqmodel==7.7.0
Run with GPTQMODEL_CPU_WORKERS=2 on a 2-core machine:
    GPTQMODEL_CPU_WORKERS=2 /work/gptqmodel-venv/bin/python scripts/gptqmodel_peer.py --method awq \\
        --model ~/.cache/quantkit/smollm2-135m-instruct --calib-ids calib_ids.safetensors \\
        --output /work/peer-out/gptqmodel-awq-w4g64-sym
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from peer_common import load_calibration_ids, peak_rss_mb


def build_config(method: str, bits: int, group_size: int, sym: bool):
    from gptqmodel import QuantizeConfig

    if method == "gptq":
        return QuantizeConfig(bits=bits, group_size=group_size, sym=sym, device="cpu")
    if method == "awq":
        return QuantizeConfig(method="awq", format="gemm", bits=bits, group_size=group_size, sym=sym, device="cpu")
    raise SystemExit(f"unknown method {method!r}")


def saved_scheme(folder: Path) -> dict:
    """What the checkpoint declares: config.json's quantization_config (quantize_config.json as a
    fallback), so a benchmark row states the scheme that was run rather than the one asked for."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not qc and (folder / "quantize_config.json").exists():
        qc = json.loads((folder / "quantize_config.json").read_text())
    qc = qc or {}
    meta = qc.get("meta") or {}
    keys = ("quant_method", "checkpoint_format", "format", "version", "bits", "group_size", "sym", "zero_point",
            "desc_act", "static_groups", "true_sequential", "damp_percent", "damp_auto_increment", "lm_head",
            "act_group_aware", "mse", "gptaq", "foem", "fallback")
    # GPTQModel 7.x keeps the method's knobs (damp_percent, static_groups, act_group_aware, ...) under "meta"
    scheme = {k: qc[k] if k in qc else meta[k] for k in keys if qc.get(k, meta.get(k)) is not None}
    if "sym" not in scheme and "zero_point" in scheme:
        scheme["sym"] = not scheme["zero_point"]
    return scheme


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, choices=["gptq", "awq"])
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-ids", required=True, help='safetensors file with "input_ids" int64 [num_samples, seq_len]')
    ap.add_argument("--output", required=True)
    ap.add_argument("--batch-size", type=int, default=1, help="quantize() calibration batch size (GPTQModel's default 1)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="model dtype during quantization; auto = GPTQModel's choice (bfloat16 on CPU)")
    sym = ap.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True, help="symmetric weights (default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric weights (zero point)")
    args = ap.parse_args()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

    import torch

    import gptqmodel
    from gptqmodel import GPTQModel

    t_total = time.perf_counter()
    ids = load_calibration_ids(args.calib_ids)
    num_samples, seq_len = ids.shape
    calibration = [{"input_ids": row.tolist(), "attention_mask": [1] * seq_len} for row in ids]

    out = Path(args.output).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    model_path = str(Path(args.model).expanduser().resolve()) if Path(args.model).expanduser().exists() else args.model
    os.chdir(out.parent)  # GPTQModel writes its run logs to ./logs: beside the checkpoint, not in the repo

    config = build_config(args.method, args.bits, args.group_size, args.sym)
    load_kwargs = {} if args.dtype == "auto" else {"dtype": getattr(torch, args.dtype)}
    model = GPTQModel.load(model_path, config, **load_kwargs)  # config.device="cpu" places the quantization
    model_dtype = str(next(model.model.parameters()).dtype).replace("torch.", "")

    t0 = time.perf_counter()
    model.quantize(calibration, batch_size=args.batch_size)
    seconds = time.perf_counter() - t0

    out.mkdir(parents=True, exist_ok=True)
    model.save(str(out))
    print(json.dumps({"seconds": round(seconds, 2), "total_seconds": round(time.perf_counter() - t_total, 2),
                      "peak_rss_mb": round(peak_rss_mb(), 1), "gptqmodel_version": gptqmodel.__version__,
                      "torch_version": torch.__version__, "method": args.method, "model_dtype": model_dtype,
                      "scheme": saved_scheme(out), "num_samples": num_samples, "seq_len": seq_len,
                      "cpu_workers": os.environ.get("GPTQMODEL_CPU_WORKERS")}))


if __name__ == "__main__":
    main()
