"""KV-cache quantization quality, side by side: KL of each KV-cache mode to the unquantized-KV run of the
same checkpoint, on held-out lee and wiki windows.

The checkpoint is written by quantkit's own CLI path (`quantkit.quantize(scheme="FP8_DYNAMIC",
kv_cache_scheme="fp8-head")`: FP8 weights, per-KV-head FP8 KV scales calibrated on --num-samples x --seq-len
lee calibration tokens) and loaded with `quantkit.load`. Each held-out window is then run teacher-forced
through that model with its keys (after RoPE) and values replaced by what the engine's cache would hand back
(quantkit.engine.kv_cache's own quantize / dequantize functions; every position reads quantized K/V, as in
decode), and compared with the same forward over unquantized K/V:

    model dtype        K/V as computed (fp32 on CPU): KL 0, the reference itself
    bf16               K/V rounded to bf16
    int8 dynamic       the engine's int8 cache (one scale per token and KV head)
    fp8 dynamic        the engine's fp8 cache (one scale per token and KV head)
    fp8 scale 1.0      a static fp8 cache without calibrated scales (what vLLM does when a checkpoint has none)
    fp8 calibrated     the checkpoint's scales per tensor (kv_cache_scheme fp8; vLLM's CPU build uses this
                       max over heads for an attn_head scheme too)
    fp8 calib. / head  the checkpoint's scales per KV head (kv_cache_scheme fp8-head; quantkit's engine)

--engine-windows N adds a cross-check through the engine itself: N windows of --engine-len tokens,
teacher-forced through LLMEngine decode (one token of prefill, then every K/V read from the paged cache),
KL against the model-dtype engine, for int8, fp8 dynamic and fp8 with the checkpoint's scales.

    python scripts/bench_kv_cache.py [--windows 16] [--num-samples 64] [--seq-len 512] [--engine-windows 2]
                                     [--checkpoint FOLDER]   # score a folder already written
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def kl_per_token(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || q) per position, [B, T]."""
    lp = F.log_softmax(ref_logits.float(), -1)
    lq = F.log_softmax(logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def modes(k_scales: torch.Tensor, v_scales: torch.Tensor):
    """{name: fn(layer, key [B, KVH, T, D], value) -> (key, value)} through the engine cache's arithmetic."""
    from quantkit.engine.kv_cache import dequantize_kv, quantize_kv, quantize_kv_static

    def dynamic(dtype):
        def fn(i, k, v):
            return tuple(dequantize_kv(*quantize_kv(x.transpose(1, 2), dtype), x.dtype).transpose(1, 2) for x in (k, v))
        return fn

    def static(ks, vs):
        def fn(i, k, v):
            return tuple(dequantize_kv(*quantize_kv_static(x.transpose(1, 2), s[i]), x.dtype).transpose(1, 2)
                         for x, s in ((k, ks), (v, vs)))
        return fn

    per_tensor = (k_scales.amax(1, keepdim=True).expand_as(k_scales), v_scales.amax(1, keepdim=True).expand_as(v_scales))
    ones = torch.ones_like(k_scales)
    return {
        "model dtype": lambda i, k, v: None,
        "bf16": lambda i, k, v: (k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)),
        "int8 dynamic": dynamic(torch.int8),
        "fp8 dynamic": dynamic(torch.float8_e4m3fn),
        "fp8 scale 1.0": static(ones, ones),
        "fp8 calibrated": static(*per_tensor),
        "fp8 calib. / head": static(k_scales, v_scales),
    }


def score(model, windows: torch.Tensor, fns: dict, batch: int) -> dict[str, tuple[float, float]]:
    """{mode: (mean KL per token, standard error over windows)} against the unquantized-KV forward."""
    from quantkit.kv_calibration import tap_kv_states

    per_window = {name: [] for name in fns}
    with torch.inference_mode():
        for s in range(0, windows.shape[0], batch):
            x = windows[s:s + batch]
            ref = model(input_ids=x, use_cache=False).logits
            for name, fn in fns.items():
                if name == "model dtype":  # the reference itself
                    per_window[name].extend([0.0] * x.shape[0])
                    continue
                with tap_kv_states(model, fn):
                    out = model(input_ids=x, use_cache=False).logits
                per_window[name].extend(kl_per_token(ref, out).mean(-1).tolist())
    out = {}
    for name, vals in per_window.items():
        t = torch.tensor(vals, dtype=torch.float64)
        out[name] = (float(t.mean()), float(t.std() / len(vals) ** 0.5) if len(vals) > 1 else 0.0)
    return out


def engine_kl(model, windows: torch.Tensor) -> dict[str, float]:
    """Teacher-forced decode through LLMEngine per KV-cache dtype, mean KL (positions 1..) to the model-dtype engine."""
    from quantkit.engine import LLMEngine, SamplingParams
    from quantkit.engine.sampler import Sampler

    class Forcing(Sampler):
        def __init__(self, forced):
            self.forced, self.logits = forced, []

        def __call__(self, logits, seqs):
            self.logits.append(logits[0].float().clone())
            return [self.forced[len(self.logits) - 1]]

    def run(kv, row, static=True):
        saved = getattr(model, "kv_cache_scales", None)
        if not static and saved is not None:
            del model.kv_cache_scales
        try:
            eng = LLMEngine(model, block_size=16, num_kv_blocks=row.numel() // 16 + 2, kv_cache_dtype=kv)
            eng.sampler = Forcing(row[1:].tolist())
            eng.generate([row[:1].tolist()], SamplingParams(temperature=0.0, max_tokens=row.numel() - 1,
                                                            ignore_eos=True))
            return torch.stack(eng.sampler.logits)[1:], eng.kv_cache.name
        finally:
            if saved is not None:
                model.kv_cache_scales = saved

    out: dict[str, list] = {}
    for row in windows:
        ref, _ = run("auto", row)
        for label, kv, static in (("int8 dynamic", "int8", True), ("fp8 dynamic", "fp8", False),
                                  ("fp8 calibrated", "fp8", True)):
            logits, name = run(kv, row, static)
            out.setdefault(f"{label} [{name}]", []).append(float(kl_per_token(ref[None], logits[None]).mean()))
    return {k: sum(v) / len(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=16, help="held-out windows per corpus")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=64, help="calibration sequences (lee)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--engine-windows", type=int, default=2)
    ap.add_argument("--engine-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--checkpoint", default=None, help="score this folder (written with --kv-cache-scheme) instead of "
                                                      "writing one; a per-tensor scheme has no per-head row")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import quantkit
    from quantkit.data import eval_token_stream
    from quantkit.runtime.loader import load_tokenizer
    from quantkit.scoring import windows_of

    if args.checkpoint:
        model, tok = quantkit.load(args.checkpoint), load_tokenizer(args.checkpoint)
        import json

        recipe = (Path(args.checkpoint) / "recipe.yaml").read_text()
        scheme = json.loads((Path(args.checkpoint) / "config.json").read_text())["quantization_config"]
        print(f"checkpoint: {args.checkpoint} (kv_cache_scheme strategy {scheme['kv_cache_scheme']['strategy']}); "
              f"its recipe.yaml:\n" + "\n".join("  " + line for line in recipe.splitlines()
                                                if line.split(":")[0].strip() in ("scheme", "kv_cache_scheme",
                                                                                   "dataset", "num_samples", "seq_len")))
        per_head = scheme["kv_cache_scheme"]["strategy"] == "attn_head"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "demo-fp8-kv"
            t0 = time.perf_counter()
            quantkit.quantize("demo", scheme="FP8_DYNAMIC", kv_cache_scheme="fp8-head", dataset="lee",
                              num_samples=args.num_samples, seq_len=args.seq_len, output=out, progress=False)
            t_quant = time.perf_counter() - t0
            model = quantkit.load(str(out))
            tok = load_tokenizer(str(out))
        print(f"checkpoint: demo, FP8_DYNAMIC weights + kv_cache_scheme fp8-head calibrated on {args.num_samples} x "
              f"{args.seq_len} lee tokens ({t_quant:.0f} s incl. calibration)")
        per_head = True
    k_scales, v_scales = model.kv_cache_scales
    print(f"scales k {float(k_scales.min()):.3g}..{float(k_scales.max()):.3g}, "
          f"v {float(v_scales.min()):.3g}..{float(v_scales.max()):.3g}")
    fns = modes(k_scales, v_scales)
    if not per_head:
        del fns["fp8 calib. / head"]
    results = {}
    for corpus in ("lee", "wiki"):
        w = windows_of(eval_token_stream(corpus, tok, "eval", max_tokens=args.windows * args.seq_len + 1),
                       args.seq_len, args.windows)
        t0 = time.perf_counter()
        results[corpus] = score(model, w, fns, args.batch)
        print(f"  {corpus}: {w.shape[0]} held-out windows x {w.shape[1]} tokens, {time.perf_counter() - t0:.0f} s")
    print(f"\nmean KL per token to the unquantized-KV run (+- standard error over windows)")
    print(f"{'KV cache':<20}" + "".join(f"{c:>24}" for c in results) + f"{'vs int8 (lee, wiki)':>24}")
    for name in fns:
        cells = "".join(f"{results[c][name][0]:>14.5f} +- {results[c][name][1]:<7.5f}" for c in results)
        ratio = ", ".join(f"{results[c][name][0] / results[c]['int8 dynamic'][0]:.2f}" for c in results)
        print(f"{name:<20}{cells}{ratio:>24}")
    if args.engine_windows:
        w = windows_of(eval_token_stream("lee", tok, "eval", max_tokens=args.engine_windows * args.engine_len + 1),
                       args.engine_len, args.engine_windows)
        t0 = time.perf_counter()
        res = engine_kl(model, w)
        print(f"\nthrough LLMEngine (teacher-forced decode, {w.shape[0]} lee windows x {w.shape[1]} tokens, "
              f"{time.perf_counter() - t0:.0f} s): mean KL to the model-dtype engine")
        for name, kl in res.items():
            print(f"  {name:<40}{kl:.5f}")
        calibrated = "fp8 calib. / head" if per_head else "fp8 calibrated"
        sub = score(model, w, {k: fns[k] for k in ("int8 dynamic", "fp8 dynamic", calibrated)}, args.batch)
        print("  the same windows through the fake-quantized forward: " +
              ", ".join(f"{k} {v[0]:.5f}" for k, v in sub.items()))


if __name__ == "__main__":
    main()
