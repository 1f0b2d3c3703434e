#!/usr/bin/env python
"""Decode speed of the demo model through quantkit's engine against transformers' ``generate``.

Batch 1, the same prompt and the same number of new tokens (EOS ignored) for every row, one
timed run each (after a two-token warm-up), or with ``--repeats R`` R rounds in which every row runs
once (all models stay loaded), the table showing each row's median run and the per-round ratios
against transformers fp32 printed below it (this machine's speed drifts by 10-30 % within minutes):

* transformers ``generate`` (greedy) on the unquantized demo model in fp32 and bf16,
* the engine on the unquantized fp32 model,
* the engine on RTN int4 (w4g64) and int8 (per channel) checkpoints of the demo model (made here with
  ``quantkit.quantize("demo", "rtn", bits=..)`` unless ``--workdir`` already holds them), with
  the ``cpu`` backend on CPU and ``auto`` (Triton) on GPU.

Decode tokens/s excludes the prefill: for transformers it is ``(N - 1) / (t(N) - t(1))`` (two
``generate`` calls, N and 1 new tokens), for the engine the time of its decode steps. Ratios
are printed against both transformers rows.

On CPU a row "Python layer loop" runs the same int4 checkpoint with the engine's C decode step
switched off (``QUANTKIT_CPU_DECODE_STEP=0``: the same kernels called layer by layer from Python), and a
row "PyTorch int4 kernel" with the cpu backend's own decode kernel switched off too
(``QUANTKIT_CPU_DECODE_KERNEL=0``: PyTorch's bf16 int4 kernel at every size, the Python loop), so
each step is compared in the same rounds.

``--lm-head-quant int8,int4`` adds rows for the int4 checkpoint (fp32 activations) decoding through
an RTN copy of the LM head only (``LLMEngine(lm_head_quant=...)``, the tied embedding untouched) and
prints what that costs in quality on held-out Lee text through the fp32 demo model: top-1 agreement
and mean KL(full head || quantized head) of the next-token distributions.

``--llamacpp-python PY`` (a Python with llama-cpp-python, e.g. its own venv; or the environment
variable QUANTKIT_LLAMACPP_PYTHON) adds llama.cpp on the demo's own Q4_1 GGUF as a row, measured in
the same rounds with the same prompt tokens, threads and new tokens, prefill excluded
(``scripts/llamacpp_decode.py``); ``--llamacpp-gguf A.gguf,B.gguf`` adds llama.cpp rows on other files
(e.g. the Q4_0 ones scripts/bench_gguf.py writes).

Then batch 16: the int4 model through the engine with 16 different random prompts submitted at
once (continuous batching) against the same 16 prompts run one after another (prefix caching off
for both); output tokens/s of each and the ratio. "identical outputs" counts requests whose greedy
tokens agree between the two. The decode kernels compute each row alone (batch-invariant), but
the prefill of 16 prompts at once goes through PyTorch's bf16 int4 kernel at another size than one
prompt's, which may round differently, so near-ties on random prompts can flip.

    python scripts/bench_decode.py                       # CPU (or GPU when present)
    python scripts/bench_decode.py --repeats 5 --batch 0  # medians of 5 interleaved rounds
    python scripts/bench_decode.py --device cuda --new-tokens 128 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompt(tok, n: int) -> list[int]:
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type, oil-based ink and a wooden press. Within decades, ")
    ids = tok(text)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def hf_decode(model, prompt: list[int], n: int) -> dict:
    import torch

    device = next(model.parameters()).device
    x = torch.tensor([prompt], device=device)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)

    def timed(k):
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=k, min_new_tokens=k, **kw)
        _sync(device)
        assert out.shape[1] == len(prompt) + k
        return time.perf_counter() - t0

    timed(2)  # warm-up
    t1, tn = timed(1), timed(n)
    return {"decode_tokens_per_s": (n - 1) / max(tn - t1, 1e-9), "tokens_per_s": n / tn}


def engine_decode(engine, prompt: list[int], n: int, keep_tokens: bool = False) -> dict:
    """Decode speed of one timed greedy run after a short warm-up; ``keep_tokens``: the tokens too."""
    from quantkit.engine import SamplingParams

    # warm-up at the timed prompt's length (on GPU the prefill's GEMM shape is autotuned on first use),
    # reversed so that the prefix cache cannot serve the timed prompt's blocks
    engine.generate([prompt[::-1]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.reset_metrics()
    t0 = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    wall = time.perf_counter() - t0
    assert len(out[0]["token_ids"]) == n
    m = engine.get_metrics()
    row = {"decode_tokens_per_s": m["decode_tokens_per_s"], "tokens_per_s": n / wall, "ttft_ms": m["ttft_ms"],
           "tpot_ms": m["tpot_ms"]}
    if keep_tokens:
        row["token_ids"] = out[0]["token_ids"]
    return row


def switched_off(build, variable: str):
    """``build()`` with the environment switch `variable` set to "0" (restored after): the cpu
    backend's decode kernels (``QUANTKIT_CPU_DECODE_KERNEL``: PyTorch's int4 kernel at every size) or the
    engine's C decode step (``QUANTKIT_CPU_DECODE_STEP``: the Python layer loop)."""
    from quantkit.runtime import backends

    old = os.environ.get(variable)
    os.environ[variable] = "0"
    backends.cpu_decode_kernel.cache_clear()
    try:
        return build()
    finally:
        if old is None:
            os.environ.pop(variable)
        else:
            os.environ[variable] = old
        backends.cpu_decode_kernel.cache_clear()


def batch_vs_sequential(engine, prompts: list[list[int]], n: int) -> dict:
    from quantkit.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine.reset_metrics()
    t0 = time.perf_counter()
    together = engine.generate(prompts, sp)
    batched = time.perf_counter() - t0
    m = engine.get_metrics()
    t0 = time.perf_counter()
    alone = [engine.generate([p], sp)[0] for p in prompts]
    sequential = time.perf_counter() - t0
    total = len(prompts) * n
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(together, alone))
    return {"batch": len(prompts), "continuous_tokens_per_s": total / batched,
            "sequential_tokens_per_s": total / sequential, "speedup": sequential / batched,
            "identical_outputs": f"{same}/{len(prompts)}", "kv_blocks_used": m["kv_blocks_used"],
            "kv_blocks_total": m["kv_blocks_total"]}


def llamacpp_decode(python: str, prompt: list[int], n: int, threads: int, gguf: Optional[str] = None) -> dict:
    """One llama.cpp decode run (scripts/llamacpp_decode.py in `python`'s environment) on `gguf`
    (default: the demo GGUF)."""
    import subprocess

    from quantkit.assets import demo_gguf_path

    req = {"gguf": str(gguf or demo_gguf_path()), "prompt_ids": prompt, "new_tokens": n, "threads": threads,
           "repeats": 1}
    out = subprocess.run([python, str(Path(__file__).with_name("llamacpp_decode.py"))], input=json.dumps(req),
                         capture_output=True, text=True, check=True, timeout=1800)
    rate = json.loads(out.stdout)["decode_tokens_per_s"][0]
    return {"decode_tokens_per_s": rate, "tokens_per_s": rate}


def head_quality(model, tok, modes: list[str], tokens: int = 512) -> dict:
    """Top-1 agreement and mean KL(full || quantized) of next-token distributions with the LM head
    quantized alone, on held-out Lee text (one window of `tokens`) through the engine's prefill."""
    import torch

    from quantkit.data import eval_token_stream
    from quantkit.engine import engine_logits_fn

    x = eval_token_stream("lee", tok)[:tokens][None]
    full = engine_logits_fn(model, block_size=16)(x)[0].float().log_softmax(-1)
    out = {}
    for mode in modes:
        quant = engine_logits_fn(model, block_size=16, lm_head_quant=mode)(x)[0].float().log_softmax(-1)
        kl = torch.nn.functional.kl_div(quant, full, log_target=True, reduction="none").sum(-1)
        kept = torch.isfinite(quant)  # a shortlist head: -inf outside its candidates, so KL is infinite
        out[mode] = {"top1_agreement": float((quant.argmax(-1) == full.argmax(-1)).float().mean()),
                     "mean_kl": float(kl.mean()) if bool(kept.all()) else None, "tokens": int(x.shape[1]),
                     "mass_in_candidates": float(full.exp().masked_fill(~kept, 0).sum(-1).mean())}
    return out


def ensure_checkpoint(bits: int, workdir: Path) -> Path:
    import quantkit

    # int8 per output channel: the only int8 layout PyTorch's packed CPU kernel (_weight_int8pack_mm) takes
    group_size = 64 if bits == 4 else -1
    out = workdir / (f"demo-rtn-w{bits}g64" if bits == 4 else f"demo-rtn-w{bits}pc")
    if (out / "config.json").is_file():
        return out
    print(f"[bench] quantizing the demo model to int{bits} (rtn) -> {out}", file=sys.stderr, flush=True)
    quantkit.quantize("demo", "rtn", bits=bits, group_size=group_size, output=str(out), progress=False, overwrite=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 32 on CPU, 128 on GPU)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default 32 CPU, 128 GPU)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every batch-1 row, interleaved; the table shows each row's median run")
    ap.add_argument("--batch", type=int, default=16, help="requests for the continuous-batching comparison (0: skip)")
    ap.add_argument("--workdir", default=None, help="folder for the int4/int8 checkpoints (reused when present)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rows", default=None, help="regex: time only the rows whose name matches (e.g. 'engine')")
    ap.add_argument("--lm-head-quant", default="", help="comma list of int8, int4: rows with the LM head quantized")
    ap.add_argument("--llamacpp-python", default=os.environ.get("QUANTKIT_LLAMACPP_PYTHON"),
                    help="a Python with llama-cpp-python: adds llama.cpp on the demo GGUF as a row")
    ap.add_argument("--llamacpp-gguf", default="", help="comma list of further GGUF files for llama.cpp rows "
                    "(e.g. the Q4_0 files scripts/bench_gguf.py writes); needs --llamacpp-python")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    import torch

    import quantkit
    from quantkit.engine import LLMEngine
    from quantkit.runtime.loader import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    dev_name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev_name)
    gpu = device.type == "cuda"
    P = args.prompt_len or (128 if gpu else 32)
    N = args.new_tokens or (128 if gpu else 32)
    B = args.batch
    tok = load_tokenizer("demo")
    prompt = make_prompt(tok, P)
    blocks = max(B, 1) * math.ceil((P + N) / 16) + 8

    def engine_for(model, prefix_caching=True):
        return LLMEngine(model, tok, num_kv_blocks=blocks, max_num_seqs=max(B, 1), kv_cache_dtype=args.kv_cache_dtype,
                         enable_prefix_caching=prefix_caching)

    # row name -> a function timing one run, models kept loaded; prefix caching off so that every
    # round prefills the prompt again, as the first one does
    measures: dict[str, object] = {}
    errors: dict[str, str] = {}
    keep = []
    extra: dict = {}

    def failed(name, exc):  # a missing piece (e.g. a backend) should not sink the other rows
        traceback.print_exc()
        errors[name] = f"{type(exc).__name__}: {exc}"

    for dtype in ("float32", "bfloat16"):
        model = quantkit.load("demo", device=str(device), dtype=dtype)
        keep.append(model)
        measures[f"transformers generate {dtype}"] = lambda m=model: hf_decode(m, prompt, N)
        if dtype == "float32":
            name = "engine fp32 (unquantized)"
            measures[name] = None
            try:
                measures[name] = lambda e=engine_for(model, False): engine_decode(e, prompt, N)
            except Exception as exc:
                failed(name, exc)

    tmp = None
    workdir = Path(args.workdir) if args.workdir else Path(tmp := tempfile.mkdtemp(prefix="qk-bench-"))
    backend = "auto" if gpu else "cpu"
    # on CPU, decode-sized int4/int8 matmuls run quantkit's int8-activation kernels (fp32 in and out)
    # and PyTorch's bf16 kernels above 16 rows; bf16 activations halve the LM head's bytes but make
    # every other op slower on AVX2, so both are shown
    act_dtypes = (None, "bfloat16") if not gpu else (None,)
    batch_model = None
    for bits, act_dtype in [(b, d) for b in (4, 8) for d in act_dtypes]:
        name = f"engine int{bits} rtn (backend {backend}" + (f", {act_dtype} act)" if act_dtype else ")")
        measures[name] = None
        try:
            path = ensure_checkpoint(bits, workdir)
            model = quantkit.load(str(path), backend=backend, device=str(device), dtype=act_dtype)
            measures[name] = lambda e=engine_for(model, False): engine_decode(e, prompt, N)
        except Exception as exc:
            failed(name, exc)
            continue
        keep.append(model)
        if bits == 4 and act_dtype is None:
            batch_model = (name, model)
        for mode in [m for m in args.lm_head_quant.split(",") if m] if (bits, act_dtype) == (4, None) else []:
            measures[f"{name[:-1]}, {mode} head)"] = \
                lambda e=LLMEngine(model, tok, num_kv_blocks=blocks, max_num_seqs=1, enable_prefix_caching=False,
                                   lm_head_quant=mode): engine_decode(e, prompt, N)
    # the same int4 checkpoint through the Python layer loop (same kernels), and through PyTorch's int4
    # kernel at every size (and the Python loop), for the A/Bs
    for name, variable in ([("engine int4 rtn (backend cpu, Python layer loop)", "QUANTKIT_CPU_DECODE_STEP"),
                            ("engine int4 rtn (backend cpu, PyTorch int4 kernel)", "QUANTKIT_CPU_DECODE_KERNEL")]
                           if not gpu else []):
        measures[name] = None
        try:
            model = quantkit.load(str(ensure_checkpoint(4, workdir)), backend=backend, device=str(device))
            keep.append(model)
            measures[name] = lambda e=switched_off(lambda: engine_for(model, False), variable): \
                engine_decode(e, prompt, N)
        except Exception as exc:
            failed(name, exc)
    if args.llamacpp_python:
        measures["llama.cpp (demo Q4_1 GGUF)"] = lambda: llamacpp_decode(args.llamacpp_python, prompt, N,
                                                                          torch.get_num_threads())
        for path in [p for p in args.llamacpp_gguf.split(",") if p]:
            measures[f"llama.cpp ({Path(path).parent.name}/{Path(path).name})"] = \
                lambda path=path: llamacpp_decode(args.llamacpp_python, prompt, N, torch.get_num_threads(), path)

    if args.rows:
        import re

        measures = {name: m for name, m in measures.items() if re.search(args.rows, name)}
    # rounds: every row once per round, so a slow spell of this machine hits all rows alike
    runs: dict[str, list[dict]] = {name: [] for name in measures}
    for r in range(args.repeats):
        for name, measure in measures.items():
            if name in errors:
                continue
            try:
                runs[name].append(measure())
            except Exception as exc:
                failed(name, exc)
                continue
            print(f"[bench] round {r + 1}: {name}: {runs[name][-1]['decode_tokens_per_s']:.1f} decode tok/s",
                  file=sys.stderr, flush=True)
    rows: dict[str, dict] = {}
    for name in measures:
        if name in errors:
            rows[name] = {"error": errors[name]}
            continue
        by_rate = sorted(runs[name], key=lambda x: x["decode_tokens_per_s"])
        rows[name] = {**by_rate[(len(by_rate) - 1) // 2],  # the median run (the lower middle of an even count)
                      "decode_tokens_per_s_runs": [x["decode_tokens_per_s"] for x in runs[name]]}

    modes = [m for m in args.lm_head_quant.split(",") if m]
    if modes:
        extra["lm_head_quality"] = head_quality(keep[0], tok, modes)
    if batch_model is not None and B > 1:
        name, model = batch_model
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 49000, (P,), generator=g).tolist() for _ in range(B)]
        try:  # prefix caching off: the sequential runs must not reuse the batched run's K/V
            extra["batch"] = {"model": name, **batch_vs_sequential(engine_for(model, False), prompts, N)}
        except Exception as exc:
            traceback.print_exc()
            extra["batch"] = {"error": f"{type(exc).__name__}: {exc}"}
    del keep

    # the packed int4/int8 CPU kernels and bf16 arithmetic pick their code path by instruction set, so
    # the ratios move with it (an AVX2 and an AVX-512 EPYC gave 2.5x and 4.5x for the int4 bf16 row)
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.cuda.get_device_name(device)
    base32 = rows.get("transformers generate float32", {}).get("decode_tokens_per_s")
    base16 = rows.get("transformers generate bfloat16", {}).get("decode_tokens_per_s")
    print(f"\ndemo model (SmolLM2-135M), device {device} ({isa}), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, "
          f"prompt {P} tokens, {N} new tokens, batch 1, "
          + ("one run each" if args.repeats == 1 else f"median of {args.repeats} interleaved rounds"))
    print(f"{'':56s} {'decode tok/s':>12s} {'e2e tok/s':>10s} {'vs HF fp32':>11s} {'vs HF bf16':>11s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:56s} failed: {r['error'][:80]}")
            continue
        d = r["decode_tokens_per_s"]
        ratio = lambda b: f"{d / b:10.2f}x" if b else f"{'-':>11s}"  # noqa: E731
        print(f"{name:56s} {d:12.1f} {r['tokens_per_s']:10.1f} {ratio(base32)} {ratio(base16)}")
    hf32 = rows.get("transformers generate float32", {}).get("decode_tokens_per_s_runs")
    if args.repeats > 1 and hf32:
        print("\nper round, against transformers fp32 of the same round:")
        for name, r in rows.items():
            if "error" not in r and name != "transformers generate float32":
                ratios = [a / b for a, b in zip(r["decode_tokens_per_s_runs"], hf32)]
                print(f"{name:56s} " + " ".join(f"{x:5.2f}x" for x in ratios))
    for mode, q in extra.get("lm_head_quality", {}).items():
        print(f"LM head {mode} alone (fp32 demo, {q['tokens']} held-out Lee tokens): top-1 agreement "
              f"{q['top1_agreement']:.4f}, " + (f"mean KL {q['mean_kl']:.5f} nats" if q["mean_kl"] is not None else
                                                 f"{q['mass_in_candidates']:.4f} of the full head's probability "
                                                 "mass in its candidates (-inf elsewhere)"))
    llama = rows.get("llama.cpp (demo Q4_1 GGUF)", {}).get("decode_tokens_per_s_runs")
    if llama:
        print("\nper round, against llama.cpp of the same round:")
        for name, r in rows.items():
            if "error" not in r and name.startswith("engine int4"):
                ratios = [a / b for a, b in zip(r["decode_tokens_per_s_runs"], llama)]
                print(f"{name:56s} " + " ".join(f"{x:5.2f}x" for x in ratios))
    if "batch" in extra:
        b = extra["batch"]
        if "error" in b:
            print(f"\nbatch {B}: failed: {b['error'][:100]}")
        else:
            print(f"\nbatch {b['batch']} through the engine ({b['model']}): continuous batching "
                  f"{b['continuous_tokens_per_s']:.1f} tok/s vs {b['batch']} sequential runs "
                  f"{b['sequential_tokens_per_s']:.1f} tok/s = {b['speedup']:.2f}x "
                  f"(identical outputs {b['identical_outputs']}, KV blocks {b['kv_blocks_used']}/{b['kv_blocks_total']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "device_kind": isa, "torch": torch.__version__,
                                               "prompt_len": P, "new_tokens": N,
                                               "rows": rows, **extra}, indent=2))
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
