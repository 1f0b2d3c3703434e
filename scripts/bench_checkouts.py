#!/usr/bin/env python
"""The same quantize through two checkouts of quantkit, alternating, side by side: is a refactor free?

Why: a redesign must keep every measured speed and memory win (issue #19), and a wall time on a shared
machine swings several-fold, so the two trees run in turn, each in its own process (peak RSS is that
run's alone), `--rounds` times, and the script prints wall, CPU seconds and peak RSS per run plus
whether the two write the same weight bytes. Both trees run under this script's Python (the same
installed dependencies); each tree's own `quantkit` package comes first on PYTHONPATH. Flags that
exist in only one tree go in `--before-flags` / `--after-flags` (e.g. a later tree's `--no-mse`
to ask for the earlier default).

    git worktree add /tmp/qk-before 6300aaa
    python scripts/bench_checkouts.py --before /tmp/qk-before --after . --rounds 2 \\
        --after-flags "--no-desc-act --no-static-groups --no-mse"
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize import quantkit_cli, run  # noqa: E402


def run_tree(tree: Path, flags: list[str], out: Path) -> dict:
    """One quantize through `tree`'s CLI, run from inside the tree (`python -m` puts the working
    folder first on sys.path, ahead of PYTHONPATH); wall, CPU seconds, peak RSS and the weights' hash."""
    summary, wall = run(quantkit_cli("quantize", *flags, "--output", str(out), "--overwrite", "--json"),
                        env={"PYTHONPATH": str(tree)}, cwd=tree)
    digest = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        digest.update(f.read_bytes())
    return {"quantize_s": summary["seconds"], "process_s": round(wall, 1), "cpu_s": summary["_cpu_s"],
            "peak_rss_mb": summary.get("peak_rss_mb"), "weights_sha256": digest.hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="checkout (work tree) of the earlier quantkit")
    ap.add_argument("--after", required=True, help="checkout of the later quantkit")
    ap.add_argument("--flags", default="--method gptq --bits 4 --group-size 64 --num-samples 64 --seq-len 512",
                    help="quantize flags both trees get")
    ap.add_argument("--before-flags", default="", help="extra flags for the earlier tree only")
    ap.add_argument("--after-flags", default="", help="extra flags for the later tree only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-checkouts-"))
    trees = {"before": (Path(args.before).resolve(), args.before_flags), "after": (Path(args.after).resolve(), args.after_flags)}
    rows = []
    print(f"{'tree':7} {'round':>5} {'quantize s':>10} {'wall s':>7} {'cpu s':>7} {'RSS MB':>7}  weights")
    for r in range(args.rounds):
        for name, (tree, extra) in trees.items():
            row = {"tree": name, "round": r,
                   **run_tree(tree, shlex.split(args.flags) + shlex.split(extra), work / f"{name}-{r}")}
            rows.append(row)
            print(f"{name:7} {r:5d} {row['quantize_s']:10.1f} {row['process_s']:7.1f} {row['cpu_s']:7.1f} "
                  f"{row['peak_rss_mb'] or float('nan'):7.0f}  {row['weights_sha256']}", flush=True)
    same = len({row["weights_sha256"] for row in rows}) == 1
    print(f"same weight bytes in every run: {same}")
    print(json.dumps({"rows": rows, "same_bytes": same}))


if __name__ == "__main__":
    main()
