#!/usr/bin/env python
"""The KL a preset's activation quantization costs alone: the floor under any weight algorithm (#47).

A preset that quantizes input activations (FP8, FP8_DYNAMIC, MXFP8, NVFP4, MXFP4, W4AFP8) loses KL on its
activations whatever its weights hold. This script scores the model with its weights left in full precision and
only the inputs of the linears the preset quantizes rounded on the preset's activation grid
(`float_codecs.activations.fake_quantize`, the runtime's own reference; static scales from the input absmax over
the calibration tokens, as the writer measures them), against the unquantized model, on the same held-out windows
`quantkit eval` and scripts/bench_float_schemes.py use. When that floor is above a target ratio of a peer's whole
KL, no weight algorithm (RTN, GPTQ, SignRound) reaches the target on that preset.

    python scripts/activation_floor.py --presets FP8_DYNAMIC,MXFP8,NVFP4 --lee-windows 8 --wiki-windows 8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _hooked(model, preset, calibration: torch.Tensor, batch_size: int = 8) -> list:
    """Forward pre-hooks rounding every quantized linear's input onto `preset`'s activation grid; returns them."""
    from quantkit.activation_absmax import input_absmax
    from quantkit.float_codecs.activations import fake_quantize
    from quantkit.float_codecs.fused_global_scale import shared_absmax
    from quantkit.float_codecs.input_scales import NVFP4_INPUT_GLOBAL_SCALE, input_scale_for, tensor_name

    acts = preset.input_activations
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    scales = {}
    if preset.calibrates_activations:
        absmax = input_absmax(model, names, calibration, batch_size)
        if tensor_name(acts) == NVFP4_INPUT_GLOBAL_SCALE:
            absmax = shared_absmax(model, absmax)
        scales = {n: input_scale_for(acts, a)[1] for n, a in absmax.items()}

    def hook(name):
        return lambda module, args: (fake_quantize(args[0], acts, scales.get(name)), *args[1:])

    return [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--presets", default="FP8_DYNAMIC,MXFP8,NVFP4")
    ap.add_argument("--lee-windows", type=int, default=8)
    ap.add_argument("--wiki-windows", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=64, help="calibration sequences (static scales only)")
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit import data
    from quantkit.calibration_sources import calibration_tokens
    from quantkit.scheme_presets import preset
    from quantkit.scoring import compare, logits_of, windows_of
    from quantkit.sources import resolve_model_path

    folder = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    calibration = calibration_tokens("lee", tok, num_samples=args.num_samples, seq_len=args.seq_len, seed=0).input_ids
    windows = {d: windows_of(data.eval_token_stream(d, tok), 512, n)
               for d, n in (("lee", args.lee_windows), ("wiki", args.wiki_windows))}
    with torch.no_grad():
        base = {d: torch.cat([model(w.unsqueeze(0)).logits for w in ws]) for d, ws in windows.items()}
    for name in args.presets.split(","):
        p = preset(name)
        if p.input_activations is None:
            print(json.dumps({"preset": name, "note": "weight-only: no activation floor"}))
            continue
        hooks = _hooked(model, p, calibration)
        try:
            row = {"preset": name}
            for d, ws in windows.items():
                r = compare(logits_of(model), lambda start, ids, d=d: base[d][start:start + len(ids)], ws)
                row[d] = {k: r[k] for k in ("kl_mean", "kl_mean_stderr", "top1_agreement", "perplexity")}
        finally:
            for h in hooks:
                h.remove()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
