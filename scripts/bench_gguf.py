"""GGUF side by side on the demo model, everything scored by llama.cpp itself (llama-cpp-python).

Rows: quantkit's F32 GGUF (the original weights), quantkit GPTQ -> Q4_0 and -> Q4_K_M (optimised
on llama.cpp's grids), llama.cpp's own Q4_0 / Q4_K_M made by `llama_model_quantize` from
quantkit's F32 GGUF (round-to-nearest), the same with an importance matrix computed as llama-imatrix
does from the calibration tokens quantkit's GPTQ uses (handed to llama_model_quantize through
llama.h's llama_model_imatrix_data array; llama-cpp-python has no imatrix tool), and quantkit RTN in every other type
it writes (does llama.cpp load it, and agree with quantkit's reading?). Per row and per held-out
text (lee and wiki by default): file size, bits per weight, llama.cpp's perplexity, KL divergence of llama.cpp's next-token distribution
to the original model's (transformers fp32, the same windows; mean and 99th percentile) and top-1
agreement, quantkit's own reference perplexity of the same file (its GGUF reader + fp32 torch;
llama.cpp quantizes activations to 8 bits, so the two differ slightly) and llama.cpp decode tok/s.

llama-cpp-python is not a quantkit dependency; build it once in its own venv (CPU only, 2 cores,
about 8-15 minutes here) and run this script with that venv's site-packages on the path. Not
GGML_NATIVE: on these VMs the CPU reports AMX, a native build uses it, and `tilezero` dies with
SIGILL inside ggml_backend_amx_mul_mat (the hypervisor does not enable AMX tiles); so name the
AVX-512 features and leave AMX off:

    python3 -m venv /work/llamacpp-venv
    /work/llamacpp-venv/bin/pip install --upgrade pip
    CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_NATIVE=OFF \\
      -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \\
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \\
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
      nice -n 10 /work/llamacpp-venv/bin/pip install --no-binary llama-cpp-python --no-cache-dir \\
      "llama-cpp-python==0.3.36" numpy
    PYTHONPATH=/work/llamacpp-venv/lib/python3.11/site-packages nice -n 10 python scripts/bench_gguf.py
"""
from __future__ import annotations

import argparse
import ctypes
import json
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


def llama_quantize(src: Path, dst: Path, ftype_name: str, threads: int, imatrix: dict | None = None) -> None:
    """llama.cpp's own quantization (llama-quantize's code path), with an importance matrix if given:
    {GGUF tensor name: float32 values per input column}, handed over as llama.h's
    null-terminated llama_model_imatrix_data array (what llama-quantize builds from an imatrix file)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = threads
    if imatrix:
        values = {name: np.ascontiguousarray(v, dtype=np.float32) for name, v in imatrix.items()}
        names = {name: name.encode() for name in values}  # kept alive until the call returns
        entries = (llama_cpp.llama_model_imatrix_data * (len(values) + 1))()
        for entry, (name, v) in zip(entries, values.items()):
            entry.name, entry.size = names[name], v.size
            entry.data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[len(values)].name = None  # the terminator
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {ftype_name} failed ({rc})")


def scores(logits: list[torch.Tensor], ref: list[torch.Tensor], windows: torch.Tensor) -> dict:
    """Perplexity, KL and top-1 of `logits` against `ref`, window by window, through quantkit's own
    running totals (`scoring.Comparison`, the numbers `quantkit eval` prints), in float64 here because
    llama.cpp's logits and the reference come from different runtimes."""
    from quantkit.scoring import Comparison

    acc = Comparison()
    for lg, rf, row in zip(logits, ref, windows):
        acc.add(F.log_softmax(lg[:-1].double(), -1), F.log_softmax(rf[:-1].double(), -1), row[1:])
    s = acc.summary()
    return {"ppl": s["perplexity"], "kl_mean": s["kl_mean"], "kl_p99": s["kl_p99"], "top1": s["top1_agreement"]}


FLOAT_TYPES = ("F16", "BF16")  # written by `convert` from the unquantized model
ALL_TYPES = FLOAT_TYPES + ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K", "Q4_1", "Q4_0")


def importance_matrix(tok, num_samples: int, seq_len: int) -> dict:
    """llama-imatrix's statistic, from the calibration tokens quantkit's GPTQ rows use (lee, seed 0):
    per GGUF weight, the mean over tokens of each input column's squared activation, taken on the
    unquantized model (fp32 transformers). The tied output head is left out, as llama-imatrix does
    by default."""
    from quantkit import data
    from quantkit.assets import demo_model_dir
    from quantkit.formats.gguf.plan import gguf_name
    from quantkit.runtime.loader import load_model

    model = load_model(str(demo_model_dir()), dtype="float32")
    sums, counts, hooks = {}, {}, []

    def observe(name):
        def hook(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and gguf_name(f"{name}.weight"):
            hooks.append(module.register_forward_hook(observe(name)))
    with torch.no_grad():
        for row in data.calibration_batches("lee", tok, num_samples=num_samples, seq_len=seq_len, seed=0):
            model(row.unsqueeze(0))
    for h in hooks:
        h.remove()
    return {gguf_name(f"{n}.weight"): (sums[n] / counts[n]).float().numpy() for n in sums}


def held_out_windows(dataset: str, tok, n: int, seq_len: int) -> torch.Tensor:
    """Up to `n` windows of the dataset's held-out split (lee's holds 12 of 512), as quantkit eval cuts them."""
    from quantkit import data
    from quantkit.scoring import windows_of

    return windows_of(data.eval_token_stream(dataset, tok, max_tokens=n * seq_len), seq_len, n)


def score_file(path: Path, windows: dict, ref: dict, threads: int) -> dict:
    """llama.cpp's and quantkit's own scores of one GGUF on every held-out set."""
    from quantkit.runtime.loader import load_model

    r = {}
    qk = load_model(str(path))  # quantkit's reader, fp32 torch forward of the same weights
    for name, w in windows.items():
        r[name] = scores(llama_logits(path, w, threads), ref[name], w)
        with torch.no_grad():
            r[name]["quantkit_ppl"] = scores([qk(row.unsqueeze(0)).logits[0].float() for row in w], ref[name], w)["ppl"]
    del qk
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="bench-gguf-work")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of --seq-len tokens per dataset (at most what it holds)")
    ap.add_argument("--datasets", default="lee,wiki", help="held-out texts scored (comma-separated)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=128, help="GPTQ calibration sequences")
    ap.add_argument("--rtn-types", default=",".join(ALL_TYPES),
                    help="types also written by quantkit (RTN; F16/BF16 by convert), to check llama.cpp loads each and agrees with quantkit")
    ap.add_argument("--no-imatrix", dest="imatrix", action="store_false",
                    help="skip llama.cpp's Q4_0/Q4_K_M with an importance matrix")
    ap.add_argument("--only", default=None, help="regex: score only the rows whose name matches (files are made anyway)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import quantkit
    from quantkit.assets import demo_model_dir
    from quantkit.convert import convert
    from quantkit.runtime.loader import load_model, load_tokenizer

    work = Path(args.work)
    work.mkdir(exist_ok=True)
    tok = load_tokenizer(str(demo_model_dir()))
    windows = {d: held_out_windows(d, tok, args.windows, args.seq_len) for d in args.datasets.split(",")}
    files = {}
    f32 = work / "quantkit-F32"
    if not (f32 / "model.gguf").exists():
        convert("demo", "gguf", f32, gguf_type="F32", overwrite=True)
    files["F32 (quantkit export)"] = f32 / "model.gguf"
    imatrix = None
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
        if args.imatrix:
            own_im = work / f"llama-{t}-imatrix.gguf"
            if not own_im.exists():
                imatrix = imatrix or importance_matrix(tok, args.num_samples, args.seq_len)
                llama_quantize(f32 / "model.gguf", own_im, t, args.threads, imatrix)
            files[f"llama.cpp {t} + imatrix (same calibration tokens)"] = own_im
    for t in filter(None, args.rtn_types.split(",")):
        out = work / f"quantkit-rtn-{t}"
        if not (out / "model.gguf").exists() and t in FLOAT_TYPES:
            convert("demo", "gguf", out, gguf_type=t, overwrite=True)
        elif not (out / "model.gguf").exists():
            quantkit.quantize("demo", "rtn", format="gguf", gguf_type=t, output=out, overwrite=True, progress=False)
        files[f"quantkit {'export' if t in FLOAT_TYPES else 'RTN'} -> {t}"] = out / "model.gguf"

    original = load_model(str(demo_model_dir()), dtype="float32")
    with torch.no_grad():
        ref = {d: [original(row.unsqueeze(0)).logits[0].float() for row in w] for d, w in windows.items()}
    del original
    n_params = sum(int(np.prod(t.shape)) for t in __import__("gguf").GGUFReader(str(f32 / "model.gguf")).tensors)
    prompt = next(iter(windows.values()))[0, :32].tolist()
    rows = []
    if args.only:
        import re

        files = {name: path for name, path in files.items() if re.search(args.only, name)}
    for name, path in files.items():
        r = {"name": name, "size_mb": path.stat().st_size / 2 ** 20, "bpw": 8 * path.stat().st_size / n_params,
             **score_file(path, windows, ref, args.threads),
             "decode_tok_s": decode_tok_s(path, prompt, 64, args.threads)}
        rows.append(r)
        print(json.dumps(r), flush=True)
    names = list(windows)
    print(f"\nheld-out: {', '.join(f'{d} {w.shape[0]} x {w.shape[1]} tokens' for d, w in windows.items())}; "
          f"KL(original fp32 transformers || llama.cpp) per next token; ppl gap = llama.cpp / quantkit's own "
          f"fp32 forward of the same file - 1; {args.threads} threads")
    head = " | ".join(f"KL {d} | p99 {d} | top-1 {d} | ppl {d} (llama.cpp) | ppl gap {d}" for d in names)
    print(f"| row | size MB | bpw | {head} | decode tok/s |")
    print("|" + "---|" * (4 + 5 * len(names)))
    for r in rows:
        cells = " | ".join(f"{r[d]['kl_mean']:.4f} | {r[d]['kl_p99']:.3f} | {r[d]['top1']:.3f} | {r[d]['ppl']:.3f} | "
                           f"{100 * (r[d]['ppl'] / r[d]['quantkit_ppl'] - 1):+.2f} %" for d in names)
        print(f"| {r['name']} | {r['size_mb']:.1f} | {r['bpw']:.2f} | {cells} | {r['decode_tok_s']:.1f} |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
