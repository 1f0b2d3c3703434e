"""Where two quantized models' losses differ from the original's, token by token.

Perplexity and KL can disagree (a file with the lower KL and the higher perplexity); this splits the
loss change per held-out token so the reason shows: each model's mean entropy, KL to the original,
and the change in NLL overall, where the original's top-1 guess is right, where it is wrong, and on
tokens the original gives p < 0.01. Models are read by quantkit (any folder or .gguf it loads; GGUF
through its own reader, fp32 torch forward).

    python scripts/compare_predictions.py bench-gguf-work/quantkit-gptq-Q4_0/model.gguf \\
        bench-gguf-work/llama-Q4_0-imatrix.gguf
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F


def log_probs(path: str, windows: torch.Tensor, dtype: str | None) -> torch.Tensor:
    from quantkit.runtime.loader import load_model

    model = load_model(path, dtype=dtype) if dtype else load_model(path)
    with torch.no_grad():
        return torch.cat([F.log_softmax(model(row.unsqueeze(0)).logits[0, :-1].float(), -1) for row in windows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="quantized models (folders or .gguf files)")
    ap.add_argument("--original", default=None, help="the unquantized model (default: the demo model)")
    ap.add_argument("--datasets", default="lee,wiki")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    from quantkit import data
    from quantkit.assets import demo_model_dir
    from quantkit.runtime.loader import load_tokenizer
    from quantkit.scoring import Comparison, windows_of

    original = args.original or str(demo_model_dir())
    tok = load_tokenizer(original)
    print("| text | model | tokens | entropy | KL | ppl | dNLL all | dNLL where original top-1 right | "
          "dNLL where wrong | dNLL on p_orig < 0.01 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dataset in args.datasets.split(","):
        windows = windows_of(data.eval_token_stream(dataset, tok, max_tokens=args.windows * args.seq_len),
                             args.seq_len, args.windows)
        target = torch.cat([row[1:] for row in windows])
        ref = log_probs(original, windows, "float32")
        ref_nll = -ref.gather(1, target[:, None]).squeeze(1)
        right = ref.argmax(-1) == target
        unlikely = ref_nll > math.log(100)
        for name, lp in [("original", ref)] + [(m, log_probs(m, windows, None)) for m in args.models]:
            d = -lp.gather(1, target[:, None]).squeeze(1) - ref_nll
            entropy = float(-(lp.exp() * lp).sum(-1).mean())
            scores = Comparison()
            scores.add(lp, ref, target)
            summary = scores.summary()
            kl, ppl = summary["kl_mean"], summary["perplexity"]
            print(f"| {dataset} | {name} | {target.numel()} | {entropy:.3f} | {kl:.4f} | {ppl:.2f} | "
                  f"{float(d.mean()):+.4f} | {float(d[right].mean()):+.4f} (n={int(right.sum())}) | "
                  f"{float(d[~right].mean()):+.4f} | {float(d[unlikely].mean()):+.4f} (n={int(unlikely.sum())}) |")


if __name__ == "__main__":
    main()
