#!/usr/bin/env python
"""Quality side by side: quantkit's methods against llm-compressor's and GPTQModel's, one run.

Every row quantizes the same model with the same scheme (w4g64 symmetric unless the row says asym;
`--bits` / `--group-size` change it for every row, e.g. `--bits 3`; a group size must divide the model's input widths,
so the demo (576) takes 32 or 64, not auto-round's own default of 128)
on the same calibration token ids (drawn once with quantkit's own pipeline: `--dataset lee`, seed 0,
written to WORKDIR/calib_ids.safetensors for the peers), in its own subprocess (so peak RSS is that
run's alone). Every checkpoint is then scored by `quantkit eval --baseline MODEL` on two held-out
texts, `lee` (news) and `wiki` (Wikipedia), through the same loader: mean and 99th-percentile KL
divergence to the original model per token, top-1 agreement, perplexity. Peers run in their own
venvs (their pins clash with quantkit's): scripts/llmcompressor_peer.py, scripts/gptqmodel_peer.py and
scripts/autoround_peer.py say how to build them; a peer whose python is not given is left out (and said so).

    python scripts/bench_quality.py --workdir /tmp/qk-quality \\
        --llmcompressor-python /work/peer-venv/bin/python --gptqmodel-python /work/gptqmodel-venv/bin/python \\
        --autoround-python /work/autoround-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_quantize import quantkit_cli, run, write_calibration_ids  # noqa: E402

from quantkit.scoring import stderr  # noqa: E402

_AUTOROUND_RULE = ["--option", "sym_range=full", "--option", "mse=false", "--option", "scale_range=[0.5,1.0]",
                   "--option", "step_dtype=bfloat16"]
# quantkit rows: name -> quantize flags (beyond model, bits, group size, calibration)
QUANTKIT_ROWS = {
    "rtn": ["--method", "rtn"],
    "gptq": ["--method", "gptq"],
    # the default with its range search unweighted (each weight's rounding error counted alike, as until
    # 2026-12-07) instead of weighted by its input's mean square
    "gptq unweighted": ["--method", "gptq", "--option", "weighted_search=false"],
    "awq": ["--method", "awq", "--sym", "--format", "gptq"],  # AWQ defaults to a zero point: the sym row says so
    # the KL-best recipe (configs/best-w4.yaml): per layer the better, on held-out calibration sequences, of
    # auto-round's rule (below) at 100 steps from round-to-nearest and GPTQ + GPTAQ's solution (signround's
    # start=rtn); until 2026-12-07 best-w4 was the rule alone, the "signround 100" row
    "best": ["--recipe", "best-w4"],
    # GPTQ + GPTAQ on the full-range grid (configs/gptaq-w4.yaml, best-w4 until 2026-12-06), then with
    # small sign-gradient steps from its solution (configs/gptaq-w4-signround.yaml)
    "gptaq": ["--recipe", "gptaq-w4"],
    "gptaq signround": ["--recipe", "gptaq-w4-signround"],
    # plain GPTQ on auto-round's full-range symmetric grid (signed absmax/8: quantizers.grid.SYM_RANGES)
    "gptq full": ["--method", "gptq", "--option", "sym_range=full"],
    # auto-round's own rule in quantkit: sign-gradient rounding from round-to-nearest on the full-range
    # grid (no range search), group scales only shrinking (auto-round's min/max factors are at most 1),
    # bf16 steps as auto-round's CPU default; light = 50 steps per layer, as auto-round's light setting
    "signround light": ["--method", "rtn,signround", *_AUTOROUND_RULE, "--option", "iters=50"],
    "signround 100": ["--method", "rtn,signround", *_AUTOROUND_RULE, "--option", "iters=100"],
    "signround": ["--method", "rtn,signround", *_AUTOROUND_RULE, "--option", "iters=200"],
}
ASYM_QUANTKIT_ROWS = {"gptq asym": ["--method", "gptq", "--asym"], "awq asym": ["--method", "awq", "--asym",
                                                                                "--format", "gptq"]}
# peer rows: name -> (tool, script, method, extra flags)
PEER_ROWS = {
    "llmc gptq": ("llm-compressor", "llmcompressor_peer.py", "gptq", ["--actorder", "default", "--sym"]),
    "llmc rtn": ("llm-compressor", "llmcompressor_peer.py", "rtn", ["--sym"]),
    # its RTN with its own range search (quantkit's RTN searches each group's range by default)
    "llmc rtn mse": ("llm-compressor", "llmcompressor_peer.py", "rtn", ["--sym", "--observer", "memoryless_mse"]),
    "gptqmodel gptq": ("gptqmodel", "gptqmodel_peer.py", "gptq", ["--sym"]),
    "gptqmodel awq": ("gptqmodel", "gptqmodel_peer.py", "awq", ["--sym"]),
    # auto-round (SignRound): its light setting (50 steps per block) and its default (200)
    "autoround light": ("auto-round", "autoround_peer.py", "signround", ["--iters", "50"]),
    "autoround": ("auto-round", "autoround_peer.py", "signround", ["--iters", "200"]),
}
ASYM_PEER_ROWS = {"gptqmodel awq asym": ("gptqmodel", "gptqmodel_peer.py", "awq", ["--asym"])}
# llm-compressor's AWQ is left out: on this CPU it took 92-97 s per grid point (20 points x 3 mappings x
# 30 layers, i.e. days); `--rows "llmc awq"` runs it anyway
OPTIONAL_ROWS = {"llmc awq": ("llm-compressor", "llmcompressor_peer.py", "awq", ["--sym"])}
REFERENCE_ROW = "llmc gptq"  # the targets are ratios to llm-compressor's default GPTQ


def quantize_rows(args, work: Path, calib_ids: Path, peer_folder: str) -> list[dict]:
    rows = []
    qk_rows = {**QUANTKIT_ROWS, **(ASYM_QUANTKIT_ROWS if args.asym else {})}
    calibration = ["--dataset", "lee", "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
                   "--seed", "0"]
    for name in _selected(qk_rows, args.rows):
        out = work / name.replace(" ", "-")
        if _reused(args, out, rows):
            continue
        _forget_scores(out)
        summary, wall = run(quantkit_cli("quantize", "--model", args.model, "--bits", str(args.bits),
                                         "--group-size", str(args.group_size),
                                         *(calibration if _calibrates(qk_rows[name]) else []), *qk_rows[name],
                                         "--output", str(out), "--overwrite", "--json"))
        _keep(args, rows, out, {"row": name, "tool": "quantkit", "path": str(out), "seconds": summary["seconds"],
                          "process_s": round(wall, 1), "cpu_s": summary["_cpu_s"], "peak_rss_mb": summary["peak_rss_mb"],
                          "sym": summary["sym"]})
    pythons = {"llm-compressor": args.llmcompressor_python, "gptqmodel": args.gptqmodel_python,
               "auto-round": args.autoround_python}
    peer_rows = {**PEER_ROWS, **(ASYM_PEER_ROWS if args.asym else {}),
                 **{k: v for k, v in OPTIONAL_ROWS.items() if args.rows and k in args.rows}}
    for name in _selected(peer_rows, args.rows):
        tool, script, method, extra = peer_rows[name]
        if not pythons[tool]:
            print(f"left out: {name} (no --{tool.replace('-', '')}-python given)")
            continue
        out = work / name.replace(" ", "-")
        if _reused(args, out, rows):
            continue
        _forget_scores(out)  # the peers' scripts write into the folder without emptying it
        env = {"GPTQMODEL_CPU_WORKERS": str(os.cpu_count() or 2)} if tool == "gptqmodel" else None
        summary, wall = run([pythons[tool], str(HERE / script), "--method", method, "--model", peer_folder,
                             "--bits", str(args.bits), "--group-size", str(args.group_size), "--calib-ids",
                             str(calib_ids), "--output", str(out), *extra], env=env)
        _keep(args, rows, out, {"row": name, "tool": tool, "path": str(out), "seconds": summary["seconds"],
                          "process_s": round(wall, 1), "cpu_s": summary["_cpu_s"], "peak_rss_mb": summary["peak_rss_mb"],
                          "scheme": summary.get("scheme"), "version": summary.get("version")})
    return rows


def _calibrates(flags: list[str]) -> bool:
    """RTN reads no calibration data (quantkit refuses calibration flags for it)."""
    return flags[:2] != ["--method", "rtn"]


ROW_FILE = "bench_row.json"  # what the bench measured when it quantized the row, beside the checkpoint


def _keep(args, rows: list[dict], out: Path, row: dict) -> None:
    row["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    row["bits"], row["group_size"] = args.bits, args.group_size
    (out / ROW_FILE).write_text(json.dumps(row, indent=1))
    rows.append(row)


def _reused(args, out: Path, rows: list[dict]) -> bool:
    """With --reuse, a row this workdir already holds (same calibration ids: the workdir's) is read
    back with the time and memory measured when it was made, instead of quantized again."""
    saved = out / ROW_FILE
    if not (args.reuse and saved.is_file()):
        return False
    row = json.loads(saved.read_text())
    scheme = (row.get("bits", 4), row.get("group_size", 64))  # rows from before --bits were all w4g64
    if scheme != (args.bits, args.group_size):
        raise SystemExit(f"--reuse: {out} holds a w{scheme[0]}g{scheme[1]} row, this run asks for "
                         f"w{args.bits}g{args.group_size}; use another --workdir")
    rows.append({**row, "reused": True})
    return True


def _forget_scores(out: Path) -> None:
    """A row about to be quantized again loses the scores kept for its old checkpoint."""
    for old in out.glob("bench_scores_*.json"):
        old.unlink()


def _selected(rows: dict, wanted) -> list[str]:
    return [r for r in rows if not wanted or r in wanted]


def score_rows(args, rows: list[dict]) -> None:
    """Each row's scores on both texts. They are kept inside the row's checkpoint folder, keyed by the
    baseline, text, windows and backend, so a --reuse run scores a reused row once (a row quantized
    again replaces its folder, and with it the old scores)."""
    for row in rows:
        for dataset, windows in (("lee", args.lee_windows), ("wiki", args.wiki_windows)):
            cache = Path(row["path"]) / (f"bench_scores_{args.model.replace('/', '_')}_{dataset}_"
                                         f"{windows or 'all'}_{args.backend}.json")
            if cache.is_file():
                row[dataset] = json.loads(cache.read_text())
                continue
            r, _ = run(quantkit_cli("eval", "--model", row["path"], "--baseline", args.model, "--dataset", dataset,
                                    "--backend", args.backend, "--json",
                                    *(["--max-windows", str(windows)] if windows else [])))
            row[dataset] = {k: r[k] for k in ("kl_mean", "kl_mean_stderr", "kl_p99", "top1_agreement", "perplexity",
                                              "baseline_perplexity", "ln_ppl_ratio_stderr", "tokens", "window_kl",
                                              "window_ln_ppl_ratio")}
            cache.write_text(json.dumps(row[dataset]))


def print_paired(rows: list[dict], against: str) -> None:
    """Each row minus row `against`, window by window on the same held-out windows: the mean difference
    of KL and of ln perplexity (as a perplexity ratio, %) with its paired standard error. A difference
    within about two of its errors is not one the held-out text can tell apart."""
    ref = next((r for r in rows if r["row"] == against), None)
    if ref is None:
        print(f"--paired: no row named {against!r} in this run")
        return
    print(f"paired against '{against}' (mean difference per window +- its standard error over windows):")
    for r in rows:
        if r is ref:
            continue
        parts = []
        for dataset in ("lee", "wiki"):
            a, b = r[dataset], ref[dataset]
            kl = [x - y for x, y in zip(a["window_kl"], b["window_kl"])]
            ln = [x - y for x, y in zip(a["window_ln_ppl_ratio"], b["window_ln_ppl_ratio"])]
            dkl, dln = sum(kl) / len(kl), sum(ln) / len(ln)
            se_kl, se_ln = stderr(kl), stderr(ln)  # None over a single window
            parts.append(f"{dataset}: KL {dkl:+.4f} +- {'-' if se_kl is None else f'{se_kl:.4f}'}, ppl "
                         f"{100 * math.expm1(dln):+.2f} % +- {'-' if se_ln is None else f'{100 * se_ln:.2f}'} "
                         f"({len(kl)} windows)")
        print(f"  {r['row']:20} " + "; ".join(parts))


def _n(value) -> str:
    """A time or memory column: '-' where a row has none (a row whose peer run was recovered by hand)."""
    return f"{'-':>7}" if value is None else f"{value:7.0f}"


def print_table(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["row"] == REFERENCE_ROW), None)
    print(f"{'row':20} {'KL lee':>7} {'p99':>6} {'top1':>6} {'ppl lee':>8} {'KL wiki':>7} {'p99':>6} {'top1':>6} "
          f"{'ppl wiki':>8} {'KL/ref':>11} {'wall s':>7} {'cpu s':>7} {'RSS MB':>7}")
    for r in rows:
        lee, wiki = r["lee"], r["wiki"]
        rel = (f"{lee['kl_mean'] / ref['lee']['kl_mean']:.2f}/{wiki['kl_mean'] / ref['wiki']['kl_mean']:.2f}"
               if ref else "-")
        print(f"{r['row']:20} {lee['kl_mean']:7.4f} {lee['kl_p99']:6.2f} {lee['top1_agreement']:6.3f} "
              f"{lee['perplexity']:8.3f} {wiki['kl_mean']:7.4f} {wiki['kl_p99']:6.2f} {wiki['top1_agreement']:6.3f} "
              f"{wiki['perplexity']:8.3f} {rel:>11} {_n(r['process_s'])} {_n(r['cpu_s'])} {_n(r['peak_rss_mb'])}"
              f"{'  * ' + r['measured_at'] if r.get('reused') else ''}")
    base = rows[0]
    print(f"original model: perplexity lee {base['lee']['baseline_perplexity']:.3f} over {base['lee']['tokens']} tokens, "
          f"wiki {base['wiki']['baseline_perplexity']:.3f} over {base['wiki']['tokens']} tokens; KL/ref: KL mean "
          f"relative to '{REFERENCE_ROW}' (lee/wiki)")


def print_times(rows: list[dict]) -> None:
    """Each row's quantization time and its ratio to the reference row's, measured in this run."""
    ref = next((r for r in rows if r["row"] == REFERENCE_ROW and not r.get("reused")), None)
    print(f"{'row':20} {'seconds':>8} {'wall s':>7} {'cpu s':>7} {'/ref s':>7} {'/ref wall':>9}")
    for r in rows:
        ratios = (f"{r['seconds'] / ref['seconds']:7.3f} {r['process_s'] / ref['process_s']:9.3f}" if ref
                  else f"{'-':>7} {'-':>9}")
        print(f"{r['row']:20} {r['seconds']:8.1f} {_n(r['process_s'])} {_n(r['cpu_s'])} {ratios}"
              f"{'  * ' + r['measured_at'] if r.get('reused') else ''}")
    print(f"ratios against '{REFERENCE_ROW}' quantized in this run (seconds: the quantization call; wall: the process)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--bits", type=int, default=4, help="every row's weight bits (default 4)")
    ap.add_argument("--group-size", type=int, default=64, help="every row's group size (default 64)")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lee-windows", type=int, default=None, help="held-out windows of 512 (default: all of lee's)")
    ap.add_argument("--wiki-windows", type=int, default=128, help="held-out windows of 512 from wiki (default 128)")
    ap.add_argument("--backend", default="reference", help="runtime backend scoring every checkpoint")
    ap.add_argument("--rows", default=None, help="comma list of row names (default: all)")
    ap.add_argument("--asym", action="store_true", help="also the asymmetric rows")
    ap.add_argument("--llmcompressor-python", default=None)
    ap.add_argument("--gptqmodel-python", default=None)
    ap.add_argument("--autoround-python", default=None, help="the venv python of scripts/autoround_peer.py")
    ap.add_argument("--workdir", default="/tmp/qk-quality")
    ap.add_argument("--reuse", action="store_true",
                    help="rows already quantized in this workdir are not re-quantized (their time and RSS are those "
                         "measured then, marked with *) and their scores are read back where they were kept")
    ap.add_argument("--paired", default=None, metavar="ROW",
                    help="also print every row's KL and perplexity difference to this row, window by window, with "
                         "its paired standard error")
    ap.add_argument("--timing-only", action="store_true",
                    help="quantize the rows and print their times only, no scoring (a quiet machine's timing run; "
                         "the KL rows come from a run with scoring)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.rows = set(r.strip() for r in args.rows.split(",")) if args.rows else None
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    calib_ids = work / "calib_ids.safetensors"
    peer_folder = write_calibration_ids(args.model, args.num_samples, args.seq_len, calib_ids)
    t0 = time.perf_counter()
    rows = quantize_rows(args, work, calib_ids, peer_folder)
    if args.timing_only:
        print_times(rows)
        return
    score_rows(args, rows)
    (work / "scores.json").write_text(json.dumps({"rows": rows}))  # kept whatever the printing below does
    print(f"calibration: {args.num_samples} x {args.seq_len} Lee tokens, seed 0, identical ids for every tool; "
          f"scheme w{args.bits}g{args.group_size} symmetric unless the row says asym; scored with --backend {args.backend}; "
          f"{time.perf_counter() - t0:.0f} s in all")
    print_table(rows)
    if args.paired:
        print_paired(rows, args.paired)
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
