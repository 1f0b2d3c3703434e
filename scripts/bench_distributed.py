#!/usr/bin/env python
"""Data-parallel calibration, measured: the same bytes at every rank count, wall and CPU time,
collective traffic per decoder layer, and a model of the speed-up on N GPUs.

For each method the real CLI quantizes once in one process and once per `--nproc` value; the
checkpoints must be identical file by file. Each run's summary carries the bytes its collectives
moved (tree sums of the statistics, gathered samples, maxima, counts); per layer is that over the
decoder layers. For GPTQ a profile of the one-process run splits each layer's time into what the
ranks share out by samples (the calibration forward and the Hessian products, P), the GPTQ solves
(S_1) and one rank's row share of them at N ranks (S_N, solved again for the timing: the solve's
column loop is partly dispatch-bound, so S_N > S_1 / N), so that

    T(N) = P / N + S_N + C(N),   C(N) = 2 (N - 1) / N * bytes / bandwidth   per layer

can be evaluated, here and for Llama-3-8B's shapes next to llm-compressor's published distributed
GPTQ figures (745 s on 1 GPU, 372 s on 2, 264 s on 4; docs/guides/big_models_and_distributed/
distributed_oneshot.md of vllm-project/llm-compressor, v0.10). On a 2-core CPU the ranks share the
cores, so wall time is reported, not expected to drop.

    python scripts/bench_distributed.py --methods rtn,gptq,awq,smoothquant --nproc 2
    python scripts/bench_distributed.py --methods gptq --num-samples 16 --seq-len 128 --nproc 2,4
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Llama-3-8B: hidden 4096, intermediate 14336, 32 layers; GPTQ's distinct linear inputs per layer
# (q/k/v share one, o, gate/up share one, down): the fp32 Hessians a layer reduces
LLAMA3_8B = {"layers": 32, "hessian_floats": 3 * 4096 ** 2 + 14336 ** 2}
LLMCOMPRESSOR_8B_GPTQ_S = {1: 745.03, 2: 372.20, 4: 264.07}  # max_time, distributed_oneshot.md, v0.10.0
SHARE_RANKS = (2, 4, 8)


def tree_sha256(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def quantize(args, method: str, nproc: int, out: Path) -> dict:
    extra = ["--format", "gptq"] if method == "awq" else []
    calib = [] if method == "rtn" else ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len)]
    cmd = [sys.executable, "-m", "quantkit", "quantize", "--model", args.model, "--method", method, *extra, *calib,
           "--output", str(out), "--overwrite", "--json"] + (["--nproc", str(nproc)] if nproc > 1 else [])
    t0, c0 = time.perf_counter(), children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": time.perf_counter() - t0, "cpu_s": children_cpu() - c0, "seconds": summary["seconds"],
            "traffic": summary.get("collective_bytes", {}), "files": tree_sha256(out)}


def profile_gptq(args) -> dict:
    """One process, in this process: per decoder layer, all of its time, its GPTQ solves' time, and the
    time of one rank's row share of each solve at 2, 4 and 8 ranks (solved again here, untimed in the
    layer's total)."""
    import torch
    import transformers

    from quantkit import data
    from quantkit.api import linear_shapes
    from quantkit.models import get_adapter
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.gptq import GPTQQuantizer
    from quantkit.quantizers.gptq_core import gptq_quantize
    from quantkit.quantizers.gptq_shares import SharedSolver, row_share, share_inputs
    from quantkit.scheme import QuantScheme
    from quantkit.sources import load_source_model

    class TimedSolver(SharedSolver):
        def __init__(self):
            super().__init__()
            self.whole, self.shares, self.spent = 0.0, {n: 0.0 for n in SHARE_RANKS}, 0.0

        def solve(self, comm, name, weight, H, qparams=None, **options):
            t0 = time.perf_counter()
            result = super().solve(comm, name, weight, H, qparams=qparams, **options)
            t1 = time.perf_counter()
            self.whole += t1 - t0
            for n in SHARE_RANKS:
                part, part_qparams = share_inputs(row_share(weight.shape[0], 0, n), weight, qparams)
                t = time.perf_counter()
                gptq_quantize(part, H, qparams=part_qparams, **options)
                self.shares[n] += time.perf_counter() - t
            self.spent += time.perf_counter() - t1
            return result

    transformers.utils.logging.disable_progress_bar()
    model, tok, *_ = load_source_model(args.model, dtype=None)
    ids = data.calibration_batches("lee", tok, num_samples=args.num_samples, seq_len=args.seq_len, seed=0)
    schemes = QuantScheme(bits=4, group_size=64).resolve(linear_shapes(model))
    gptq = GPTQQuantizer()
    gptq.solver = solver = TimedSolver()
    t0 = time.perf_counter()
    quantize_model(model, get_adapter(model), gptq, schemes, ids, batch_size=args.num_samples, progress=False)
    total = time.perf_counter() - t0 - solver.spent
    layers = len(get_adapter(model).decoder_layers(model))
    return {"layers": layers, "layer_s": total / layers,
            "solve_s": {1: solver.whole / layers, **{n: v / layers for n, v in solver.shares.items()}},
            "threads": torch.get_num_threads()}


def model_time(parallel: float, solve: float, bytes_: float, n: int, bandwidth: float) -> float:
    """Seconds per layer on n ranks: the shared-out work, one rank's share of the solves, communication."""
    return parallel / n + solve + (2 * (n - 1) / n * bytes_ / bandwidth if n > 1 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--methods", default="gptq")
    ap.add_argument("--nproc", default="2", help="comma list of rank counts compared with one process")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--bandwidth-gbs", type=float, default=150.0,
                    help="all-reduce bus bandwidth of the model (GB/s; ~150 NVLink 4, ~20 PCIe 4 x16)")
    ap.add_argument("--no-profile", action="store_true", help="skip the in-process GPTQ profile")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers, for per-layer traffic without the profile")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-dist-"))
    counts = [int(n) for n in args.nproc.split(",")]
    rows = []
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        one = quantize(args, method, 1, work / f"{method}-n1")
        for n in counts:
            r = quantize(args, method, n, work / f"{method}-n{n}")
            rows.append({"method": method, "ranks": n, "identical": r["files"] == one["files"],
                         "wall_1": one["wall_s"], "cpu_1": one["cpu_s"], "wall_n": r["wall_s"], "cpu_n": r["cpu_s"],
                         "traffic": r["traffic"]})
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in rows[-1].items()}), flush=True)
    prof = None if args.no_profile or "gptq" not in args.methods else profile_gptq(args)
    layers = prof["layers"] if prof else args.layers
    print(f"\ncalibration {args.num_samples} x {args.seq_len} tokens; traffic per decoder layer, MB (rank 0's payload)")
    print(f"{'method':12} {'ranks':>5} {'same bytes':>10} {'wall 1':>8} {'wall N':>8} {'cpu 1':>8} {'cpu N':>8} "
          f"{'tree sums':>9} {'gathers':>8} {'maxima':>7} {'other':>7}")
    for r in rows:
        t = {k: v / layers / 1e6 for k, v in r["traffic"].items()}
        other = sum(v for k, v in t.items() if k not in ("tree_sum", "gather", "max"))
        print(f"{r['method']:12} {r['ranks']:5d} {str(r['identical']):>10} {r['wall_1']:8.1f} {r['wall_n']:8.1f} "
              f"{r['cpu_1']:8.1f} {r['cpu_n']:8.1f} {t.get('tree_sum', 0):9.2f} {t.get('gather', 0):8.2f} "
              f"{t.get('max', 0):7.3f} {other:7.3f}")
    if prof:
        report_model(prof, rows, args.bandwidth_gbs * 1e9)


def report_model(prof: dict, rows: list, bandwidth: float) -> None:
    gptq = next((r for r in rows if r["method"] == "gptq"), None)
    bytes_layer = gptq["traffic"].get("tree_sum", 0) / prof["layers"] if gptq else 0.0
    shares = prof["solve_s"]  # ranks -> one rank's share of the solves per layer (1: the whole solves)
    parallel = prof["layer_s"] - shares[1]
    print(f"\nGPTQ, one process ({prof['threads']} threads): {prof['layer_s']:.2f} s per layer, of which the solves "
          f"{shares[1]:.2f} s; one rank's row share of them: "
          + ", ".join(f"{shares[n]:.2f} s at {n} ranks ({shares[n] / shares[1]:.2f}x)" for n in SHARE_RANKS)
          + f"; reduced per layer {bytes_layer / 1e6:.1f} MB")
    for n in (1, *SHARE_RANKS):
        t = model_time(parallel, shares[n], bytes_layer, n, bandwidth)
        print(f"  model, {n} ranks at {bandwidth / 1e9:.0f} GB/s: {t:.2f} s per layer, speed-up {prof['layer_s'] / t:.2f}x "
              f"(communication {model_time(0, 0, bytes_layer, n, bandwidth) * 1e3:.1f} ms)")
    b8 = LLAMA3_8B["hessian_floats"] * 4
    t1 = LLMCOMPRESSOR_8B_GPTQ_S[1]
    share = shares[1] / prof["layer_s"]  # this run's solve share, carried over to 8B as an assumption
    print(f"\nLlama-3-8B: {b8 / 1e9:.2f} GB of fp32 Hessians per layer; at {bandwidth / 1e9:.0f} GB/s their all-reduce costs "
          f"{model_time(0, 0, b8, 4, bandwidth) * LLAMA3_8B['layers']:.1f} s over 32 layers on 4 ranks")
    for n, measured in LLMCOMPRESSOR_8B_GPTQ_S.items():
        predicted = (t1 * ((1 - share) / n + share * shares[n] / shares[1])
                     + model_time(0, 0, b8, n, bandwidth) * LLAMA3_8B["layers"])
        print(f"  {n} GPUs: llm-compressor {measured:.0f} s ({t1 / measured:.2f}x); this model with the solve share "
              f"({share:.0%}) and its row-share scaling measured here: {predicted:.0f} s ({t1 / predicted:.2f}x)")


if __name__ == "__main__":
    main()
