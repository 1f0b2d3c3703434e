#!/usr/bin/env python
"""Run llm-compressor's oneshot on the same model, scheme and calibration tokens as quantkit.

Why this exists: `scripts/bench_quantize.py` compares quantkit against llm-compressor (wall time,
peak RSS, held-out perplexity). This script is that comparison's *benchmark peer only*: it runs
under a separate venv where `llmcompressor` is installed (e.g. /work/peer-venv/bin/python), never
imports the quantkit package (only quantkit/memory.py, stdlib-only, loaded by path so both tools
measure peak RSS alike), and llm-compressor is never a dependency of quantkit. The calibration token ids
come from a safetensors file that bench_quantize.py writes with quantkit's own data pipeline
(key "input_ids", int64 [num_samples, seq_len]), so both tools calibrate on exactly the same tokens.

Schemes (matching quantkit's method defaults unless a flag says otherwise):
  gptq         GPTQModifier, int W{bits} group, dampening 0.01, block 128; act-order per --actorder:
               "none" (this script's default, matching quantkit's default GPTQ), "default" (leave it to
               llm-compressor: its GPTQModifier defaults to "static", alias "weight"), or "static"/"weight"
  awq          AWQModifier (duo scaling, n_grid 20; llm-compressor's AWQ has no clipping search)
               + QuantizationModifier, int W{bits} group, asymmetric unless --sym
  rtn          QuantizationModifier, int W{bits} group, symmetric unless --asym; its default observer
               (memoryless min-max) unless --observer names another (e.g. memoryless_mse: its range
               search, shrinking each group's range by up to 20 %, error norm 2.4)
  smoothquant  SmoothQuantModifier(0.5) + QuantizationModifier W8A8: int8 symmetric per-channel
               weights, int8 dynamic per-token symmetric activations
  --scheme P   gptq / rtn onto compressed-tensors preset P (FP8_DYNAMIC, NVFP4A16, MXFP4A16, ...) with the
               modifier's own defaults for it (scripts/bench_float_schemes.py); smoothquant / smoothquant+gptq:
               SmoothQuantModifier(0.5) first (presets that quantize activations: NVFP4, MXFP4, FP8...)

The checkpoint is saved with save_compressed=True (compressed-tensors pack-quantized for W4A16,
int-quantized for W8A8). The last stdout line is one JSON object; "seconds" is the oneshot call only
(wall; "cpu_seconds" its CPU time, all threads),
"scheme" is read back from the saved config.json (what the checkpoint actually declares).

The model is loaded in float32, so the observers see fp32 weights and the saved weight_scale is fp32.

Creating the venv (its pins clash with quantkit's: never install llm-compressor into quantkit's venv);
/etc/xdg/pip/constraints.txt caps torch at 2.14.1, so torch 2.13.0 comes from the local CPU wheel:
    python3 -m venv /work/peer-venv
    /work/peer-venv/bin/pip install --upgrade pip
    /work/peer-venv/bin/pip install torch==2.13.0
    /work/peer-venv/bin/pip install llmcompressor==0.14.0.1 torch==2.13.0
  (brings compressed-tensors 0.19.0, transformers 5.17.0, accelerate 1.15.0, datasets 5.2.0)

    /work/peer-venv/bin/python scripts/llmcompressor_peer.py --method gptq --actorder default \
        --model ~/.cache/quantkit/smollm2-135m-instruct --calib-ids calib_ids.safetensors \
        --output /work/peer-out/llmcompressor-gptq-w4g64-sym-actstatic
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from peer_common import load_calibration_ids, peak_rss_mb


def weight_args(bits: int, group_size: int, symmetric: bool, observer: str | None = None) -> dict:
    args = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    if observer is not None:
        args["observer"] = observer
    if group_size == -1:
        args["strategy"] = "channel"
    else:
        args.update(strategy="group", group_size=group_size)
    return args


ACTORDER_CHOICES = ("default", "none", "static", "weight")


def build_recipe(method: str, bits: int, group_size: int, symmetric: bool, actorder: str = "none",
                 observer: str | None = None, scheme: str | None = None):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    ignore = ["lm_head"]
    if scheme is not None:  # a compressed-tensors preset (FP8_DYNAMIC, NVFP4A16, MXFP4A16...), its own defaults
        smoothing = []
        if method.startswith("smoothquant"):  # llm-compressor's SmoothQuantModifier (its default strength 0.5)
            from llmcompressor.modifiers.transform import SmoothQuantModifier

            smoothing = [SmoothQuantModifier(smoothing_strength=0.5)]
            method = {"smoothquant": "rtn", "smoothquant+gptq": "gptq"}[method]
        if method == "gptq":
            from llmcompressor.modifiers.gptq import GPTQModifier

            return smoothing + [GPTQModifier(targets="Linear", scheme=scheme, ignore=ignore, dampening_frac=0.01,
                                             block_size=128)]
        if method == "rtn":
            return smoothing + [QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)]
        raise SystemExit(f"--scheme applies to --method gptq, rtn, smoothquant or smoothquant+gptq, not {method}")
    if method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        weights = weight_args(bits, group_size, symmetric)
        extra = {}
        if actorder != "default":  # "default": neither the scheme nor the modifier names one
            weights["actorder"] = None if actorder == "none" else actorder
            extra["actorder"] = weights["actorder"]
        groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
        return [GPTQModifier(config_groups=groups, ignore=ignore, dampening_frac=0.01, block_size=128, **extra)]
    if method == "awq":
        from llmcompressor.modifiers.transform import AWQModifier

        groups = {"group_0": {"targets": ["Linear"], "weights": weight_args(bits, group_size, symmetric)}}
        # offload_device=None: keep cached layer inputs where they are (CPU); nothing to offload to
        return [AWQModifier(duo_scaling=True, n_grid=20, offload_device=None),
                QuantizationModifier(config_groups=groups, ignore=ignore)]
    if method == "rtn":
        groups = {"group_0": {"targets": ["Linear"], "weights": weight_args(bits, group_size, symmetric, observer)}}
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if method == "smoothquant":
        from llmcompressor.modifiers.transform import SmoothQuantModifier

        groups = {"group_0": {"targets": ["Linear"], "weights": weight_args(8, -1, True),
                              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                    "strategy": "token", "dynamic": True}}}
        return [SmoothQuantModifier(smoothing_strength=0.5), QuantizationModifier(config_groups=groups, ignore=ignore)]
    raise SystemExit(f"unknown method {method!r}")


def saved_scheme(folder: Path) -> dict:
    """The weight scheme the saved checkpoint declares (config.json quantization_config), one entry
    per config group, so a benchmark row states what was run rather than what was asked for."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder", "observer", "dynamic")
    groups = {}
    for name, group in qc.get("config_groups", {}).items():
        w = group.get("weights") or {}
        groups[name] = {k: w.get(k) for k in keys}
        if group.get("input_activations"):
            groups[name]["input_activations"] = group["input_activations"]
    return {"format": qc.get("format"), "ignore": qc.get("ignore"), "config_groups": groups}


def disable_pinning_without_accelerator() -> list[str]:
    """AWQ pins its cached layer inputs for faster host->device copies; a CPU-only torch cannot pin
    (pin_memory needs an accelerator), so make pinning a no-op there. Returns what was changed."""
    import torch

    if torch.accelerator.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return ["IntermediatesCache.pin_memory -> no-op (no accelerator)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, choices=["gptq", "awq", "rtn", "smoothquant", "smoothquant+gptq"])
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64, help="-1: per channel")
    ap.add_argument("--calib-ids", required=True, help='safetensors file with "input_ids" int64 [num_samples, seq_len]')
    ap.add_argument("--output", required=True)
    ap.add_argument("--batch-size", type=int, default=1, help="oneshot calibration batch size (llm-compressor's default 1)")
    ap.add_argument("--actorder", choices=ACTORDER_CHOICES, default="none",
                    help='gptq only: "default" leaves it to llm-compressor (static); default here: none')
    ap.add_argument("--observer", default=None,
                    help="rtn only: llm-compressor's weight observer by its registered name (default: its own default)")
    ap.add_argument("--scheme", default=None,
                    help="gptq/rtn: a compressed-tensors preset name (e.g. NVFP4A16) instead of --bits/--group-size")
    sym = ap.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None, help="symmetric weights")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric weights (zero point)")
    args = ap.parse_args()
    if args.sym is None:
        args.sym = args.method != "awq"
    if args.method == "smoothquant" and not args.sym:
        raise SystemExit("--asym: smoothquant's W8A8 scheme here is symmetric only")
    if args.actorder != "none" and args.method != "gptq":
        raise SystemExit(f"--actorder applies to --method gptq only, not {args.method}")
    if args.observer is not None and args.method != "rtn":
        raise SystemExit(f"--observer applies to --method rtn only, not {args.method}")

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmcompressor
    from llmcompressor import oneshot

    t_total = time.perf_counter()
    ids = load_calibration_ids(args.calib_ids)
    num_samples, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, device_map=None, low_cpu_mem_usage=True)
    model.eval()
    workarounds = disable_pinning_without_accelerator() if args.method == "awq" else []

    recipe = build_recipe(args.method, args.bits, args.group_size, args.sym, args.actorder, args.observer, args.scheme)
    t0, c0 = time.perf_counter(), time.process_time()
    oneshot(model=model, tokenizer=tokenizer, recipe=recipe, dataset=ds, num_calibration_samples=num_samples,
            max_seq_length=seq_len, batch_size=args.batch_size, shuffle_calibration_samples=False)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    print(json.dumps({"seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2), "total_seconds": round(time.perf_counter() - t_total, 2),
                      "peak_rss_mb": round(peak_rss_mb(), 1), "llmcompressor_version": llmcompressor.__version__,
                      "method": args.method, "actorder_flag": args.actorder if args.method == "gptq" else None,
                      "scheme": saved_scheme(out), "num_samples": num_samples, "seq_len": seq_len,
                      "model_dtype": "float32", "workarounds": workarounds}))


if __name__ == "__main__":
    main()
