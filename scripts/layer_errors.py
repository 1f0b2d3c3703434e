#!/usr/bin/env python
"""Per-decoder-layer error of quantized checkpoints against the original, on held-out wiki windows: where
along the depth one checkpoint loses to another (issue #48: best-w4 against auto-round, docs/signround.md).

    python scripts/layer_errors.py CKPT_A CKPT_B ...      # quantkit-loadable folders of the --model

For each decoder layer i, as relative squared errors (sum of squared differences / sum of squares):
  local  the checkpoint's layer i run on the ORIGINAL model's input to layer i (the same arguments),
         against the original layer's output: what that layer's own quantization costs;
  accum  the checkpoint's own hidden state after layer i against the original's: what has accumulated
         (the last layer's is left out: transformers returns it after the final norm).
"""
from __future__ import annotations

import argparse

import torch
import transformers

import quantkit
from quantkit.calibration_sources import calibration_tokens
from quantkit.sources import resolve_model_path


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want) ** 2).sum() / (want ** 2).sum())


def layer_inputs(model, ids: torch.Tensor):
    """(each decoder layer's positional and keyword arguments in `model`'s forward on `ids`, its hidden states)."""
    captured = {}

    def capture(i):
        def hook(module, args, kwargs):
            captured[i] = (args, dict(kwargs))
        return hook

    hooks = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return captured, out.hidden_states


def first(output):
    return output[0] if isinstance(output, tuple) else output


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--model", default="demo", help="the original model the checkpoints were quantized from")
    ap.add_argument("--windows", type=int, default=4, help="held-out wiki windows")
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    base = resolve_model_path(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    ids = calibration_tokens("wiki", tokenizer, num_samples=args.windows, seq_len=args.seq_len, seed=7).input_ids
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    inputs, hidden = layer_inputs(original, ids)
    with torch.no_grad():
        wanted = [first(layer(*inputs[i][0], **inputs[i][1])) for i, layer in enumerate(original.model.layers)]
    n_layers = len(wanted)
    rows = {}
    for folder in args.checkpoints:
        model = quantkit.load(folder, dtype="float32")
        with torch.no_grad():
            own = model(ids, output_hidden_states=True, use_cache=False).hidden_states
            local = [relative_error(first(layer(*inputs[i][0], **inputs[i][1])), wanted[i])
                     for i, layer in enumerate(model.model.layers)]
        accum = [relative_error(own[i + 1], hidden[i + 1]) if i + 1 < n_layers else float("nan") for i in range(n_layers)]
        rows[folder.rstrip("/").split("/")[-1]] = (local, accum)
        del model
    names = list(rows)
    print("layer " + " ".join(f"{n[:14]:>14}" for n in names) + " | " + " ".join(f"{n[:14]:>14}" for n in names))
    print("      " + " ".join(f"{'local':>14}" for _ in names) + " | " + " ".join(f"{'accum':>14}" for _ in names))
    for i in range(n_layers):
        print(f"{i:5d} " + " ".join(f"{rows[n][0][i]:14.5f}" for n in names) + " | "
              + " ".join(f"{rows[n][1][i]:14.5f}" for n in names))
    for n in names:
        print(f"{n}: sum of local errors {sum(rows[n][0]):.4f}")


if __name__ == "__main__":
    main()
