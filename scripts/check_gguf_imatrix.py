"""quantkit's GGUF block parameters under an importance matrix against llama.cpp's own.

Run after `scripts/bench_gguf.py` (same --work folder): it reads the F32 export and llama.cpp's
Q4_0 / Q4_K_M files made with an importance matrix, recomputes that matrix the same way (bench_gguf's
`importance_matrix`, cached in the work folder), rounds every weight onto quantkit's
`choose_grid(weight, type, importance)` and compares, tensor by tensor, with what the `gguf`
package decodes from llama.cpp's file: the share of identical values, and the importance-weighted
squared error of both (and of llama.cpp's rule without an importance matrix, for scale).

    python scripts/check_gguf_imatrix.py --work bench-gguf-work
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="bench-gguf-work", help="bench_gguf.py's work folder")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    import gguf
    from gguf.quants import dequantize

    from quantkit.formats.gguf.types import TYPES
    from quantkit.quantizers.gguf_grid import choose_grid, round_to_grid

    work = Path(args.work)
    cache = work / "imatrix.npz"
    if not cache.exists():
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_gguf import importance_matrix

        from quantkit.assets import demo_model_dir
        from quantkit.runtime.loader import load_tokenizer

        np.savez(cache, **importance_matrix(load_tokenizer(str(demo_model_dir())), args.num_samples, args.seq_len))
    imatrix = dict(np.load(cache))
    original = {t.name: torch.tensor(np.array(t.data)).reshape([int(s) for s in reversed(t.shape)])
                for t in gguf.GGUFReader(str(work / "quantkit-F32" / "model.gguf")).tensors}

    def decoded(w: torch.Tensor, t, importance) -> torch.Tensor:
        p = choose_grid(w, t, importance)
        return p.on_grid(round_to_grid(w, p)).dequantize()

    print("| llama.cpp file | tensor type | tensors | identical values | weighted sq. error quantkit | llama.cpp | "
          "llama.cpp without imatrix |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("Q4_0", "Q4_K_M"):
        path = work / f"llama-{kind}-imatrix.gguf"
        stats: dict[str, list] = {}
        for t in gguf.GGUFReader(str(path)).tensors:
            if t.name not in imatrix or not TYPES.get(t.tensor_type.name, TYPES["F32"]).quantized:
                continue
            ty, w = TYPES[t.tensor_type.name], original[t.name].float()
            imp = torch.tensor(imatrix[t.name])
            theirs = torch.tensor(dequantize(np.array(t.data), t.tensor_type)).reshape(w.shape)
            ours, plain = decoded(w, ty, imp), decoded(w, ty, None)
            err = lambda v: float(((v - w).square() * imp).sum())  # noqa: E731
            s = stats.setdefault(ty.name, [0, 0, 0, 0.0, 0.0, 0.0])
            s[0] += 1
            s[1] += int((ours == theirs).sum())
            s[2] += w.numel()
            s[3] += err(ours)
            s[4] += err(theirs)
            s[5] += err(plain)
        for name, (n, same, total, e_ours, e_theirs, e_plain) in stats.items():
            print(f"| {path.name} | {name} | {n} | {same / total:.4f} | {e_ours:.4f} | {e_theirs:.4f} | {e_plain:.4f} |")


if __name__ == "__main__":
    main()
