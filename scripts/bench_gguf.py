"""GGUF side by side on the demo model, everything scored by llama.cpp itself (llama-cpp-python).

Rows: quantkit's F32 GGUF (the original weights), quantkit GPTQ -> Q4_0 and -> Q4_K_M (optimised
on llama.cpp's grids), and llama.cpp's own Q4_0 / Q4_K_M made by `llama_model_quantize` from
quantkit's F32 GGUF (round-to-nearest, no importance matrix). Per row: file size, bits per weight,
llama.cpp's perplexity on the Lee eval split, KL divergence of llama.cpp's next-token distribution
to the original model's (transformers fp32, the same windows; mean and 99th percentile) and top-1
agreement, quantkit's own reference perplexity of the same file (its GGUF reader + fp32 torch;
llama.cpp quantizes activations to 8 bits, so the two differ slightly) and llama.cpp decode tok/s.

llama-cpp-python is not a quantkit dependency; build it once in its own venv (CPU only, 2 cores,
about 15 minutes here) and run this script with that venv's site-packages on the path:

    python3 -m venv /work/llamacpp-venv
    /work/llamacpp-venv/bin/pip install --upgrade pip
    CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_NATIVE=ON \\
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
      nice -n 10 /work/llamacpp-venv/bin/pip install --no-binary llama-cpp-python --no-cache-dir \\
      "llama-cpp-python==0.3.36" numpy
    PYTHONPATH=/work/llamacpp-venv/lib/python3.11/site-packages nice -n 10 python scripts/bench_gguf.py
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def llama_logits(path: Path, windows: torch.Tensor, threads: int) -> list[torch.Tensor]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=windows.shape[1], n_batch=windows.shape[1], logits_all=True,
                          n_gpu_layers=0, verbose=False, n_threads=threads)
    out = []
    for row in windows.tolist():
        llm.reset()
        llm.eval(row)
        out.append(torch.tensor(np.array(llm.scores[:len(row)]), dtype=torch.float32))
    del llm
    return out


def decode_tok_s(path: Path, prompt: list[int], n_new: int, threads: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_gpu_layers=0, verbose=False, n_threads=threads)
    llm.eval(prompt)
    t0 = time.perf_counter()
    for _ in range(n_new):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    return n_new / (time.perf_counter() - t0)


def llama_quantize(src: Path, dst: Path, ftype_name: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {ftype_name} failed ({rc})")


def scores(logits: list[torch.Tensor], ref: list[torch.Tensor], windows: torch.Tensor) -> dict:
    nll, n, kls, top1 = 0.0, 0, [], []
    for lg, rf, row in zip(logits, ref, windows):
        lp, rp = F.log_softmax(lg[:-1].double(), -1), F.log_softmax(rf[:-1].double(), -1)
        nll += float(F.nll_loss(lp, row[1:], reduction="sum"))
        n += row.numel() - 1
        kls.append((rp.exp() * (rp - lp)).sum(-1))
        top1.append(lp.argmax(-1) == rp.argmax(-1))
    kl = torch.cat(kls)
    return {"ppl": math.exp(nll / n), "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl.float(), 0.99)),
            "top1": float(torch.cat(top1).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="bench-gguf-work")
    ap.add_argument("--windows", type=int, default=8, help="eval windows of --seq-len tokens")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=128, help="GPTQ calibration sequences")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import quantkit
    from quantkit import data
    from quantkit.assets import demo_model_dir
    from quantkit.convert import convert
    from quantkit.runtime.loader import load_model, load_tokenizer

    work = Path(args.work)
    work.mkdir(exist_ok=True)
    tok = load_tokenizer(str(demo_model_dir()))
    stream = data.eval_token_stream("lee", tok)
    windows = stream[:args.windows * args.seq_len].view(args.windows, args.seq_len)
    files = {}
    f32 = work / "quantkit-F32"
    if not (f32 / "model.gguf").exists():
        convert("demo", "gguf", f32, gguf_type="F32", overwrite=True)
    files["F32 (quantkit export)"] = f32 / "model.gguf"
    for t in ("Q4_0", "Q4_K_M"):
        out = work / f"quantkit-gptq-{t}"
        if not (out / "model.gguf").exists():
            quantkit.quantize("demo", "gptq", format="gguf", gguf_type=t, output=out, overwrite=True,
                              num_samples=args.num_samples, progress=False)
        files[f"quantkit GPTQ -> {t}"] = out / "model.gguf"
        own = work / f"llama-{t}.gguf"
        if not own.exists():
            llama_quantize(f32 / "model.gguf", own, t, args.threads)
        files[f"llama.cpp {t} (llama_model_quantize)"] = own

    original = load_model(str(demo_model_dir()), dtype="float32")
    with torch.no_grad():
        ref = [original(row.unsqueeze(0)).logits[0].float() for row in windows]
    del original
    n_params = sum(int(np.prod(t.shape)) for t in __import__("gguf").GGUFReader(str(f32 / "model.gguf")).tensors)
    rows = []
    for name, path in files.items():
        r = {"name": name, "size_mb": path.stat().st_size / 2 ** 20, "bpw": 8 * path.stat().st_size / n_params}
        r.update(scores(llama_logits(path, windows, args.threads), ref, windows))
        qk = load_model(str(path))  # quantkit's reader, fp32 torch forward of the same weights
        with torch.no_grad():
            qk_logits = [qk(row.unsqueeze(0)).logits[0].float() for row in windows]
        del qk
        r["quantkit_ppl"] = scores(qk_logits, ref, windows)["ppl"]
        r["decode_tok_s"] = decode_tok_s(path, windows[0, :32].tolist(), 64, args.threads)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{args.windows} x {args.seq_len} Lee eval tokens; KL(original || llama.cpp) per next token; "
          f"{args.threads} threads")
    print(f"| row | size MB | bpw | ppl (llama.cpp) | ppl (quantkit ref) | KL mean | KL p99 | top-1 | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['size_mb']:.1f} | {r['bpw']:.2f} | {r['ppl']:.3f} | {r['quantkit_ppl']:.3f} | "
              f"{r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['top1']:.3f} | {r['decode_tok_s']:.1f} |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
