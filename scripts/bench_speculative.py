#!/usr/bin/env python
"""Speculative decoding of the demo model through quantkit's engine: measured against the same
engine decoding alone, and against what the acceptance rate predicts.

Target: the demo model (SmolLM2-135M-Instruct) in fp32. Drafts:

* its own int4 checkpoint, by default GPTQ w4g32 asymmetric made in ``--workdir`` (``--draft PATH``
  for another, ``--draft-method rtn``, ``--draft-sym``), greedy, k = 1..8 (``--ks``). The demo's
  weights come from a Q4_1 GGUF (asymmetric 4-bit, blocks of 32), so an asymmetric g32 draft fits
  them unusually well: its acceptance is an upper end of what a natively bf16 model's int4 draft
  reaches; ``--draft-sym`` shows the other end; ``--draft`` a per-channel int8 checkpoint shows a
  dearer draft step that agrees far more often;
* the same draft with a varying draft length (``--confidence-rows k:T``, rows ``conf=T``: up to k
  tokens, a sequence stopping once the draft gives its latest token a probability below T);
* n-gram prompt lookup (no model), on a prompt whose answer quotes its context (extraction) and
  on free generation.

Each round runs every row once with all models loaded (batch 1, same prompt, EOS ignored) and
the table shows medians over ``--rounds``; speed-ups are per round, against the target alone in
the same round. Decode only (prefill excluded): tokens / time of the decode steps.

    c          = draft decode step time / target decode step time (each decoding alone)
    alpha      = per-token acceptance: accepted / (accepted + rejections)
    E[tok]     = (1 - alpha^(k+1)) / (1 - alpha), expected tokens per step
    predicted  = E[tok] / (k c + 1)   (Leviathan et al.: the verification costs one target step);
                 for a ``conf=`` row (up to k tokens, the draft stopping once it gives its latest token a
                 probability below the threshold), tok/step / (n c + 1), n the measured draft tokens per step
    measured   = speculative decode tok/s / target-alone decode tok/s
    verify/tgt = a verification step's time / a target decode step's (k + 1 rows vs 1)
    draft/tgt  = the draft's time per speculative step / a target decode step's (k c if drafting
                 cost k plain draft steps; its catch-up on the last step's tokens is an extend)
    accounted  = tok/step / (draft/tgt + verify/tgt): the speed-up the measured step parts allow;
                 measured below it is engine overhead outside the draft and the verification

Every speculative row's tokens are checked equal to the target alone's (greedy).

    python scripts/bench_speculative.py                      # 2 threads, 3 rounds, k = 1..8
    python scripts/bench_speculative.py --rounds 5 --ks 2,3,4 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

FREE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
QUOTE_PROMPT = ("Extract every sentence that mentions a date from the text below, word for word.\n\n"
                "Text: The museum opened on 3 May 1921 in a former railway station. Its first director, "
                "Anna Berg, bought the collection of steam engines in 1925. The west wing burned down on "
                "12 January 1958 and was rebuilt by 1961. Today the museum welcomes about 200,000 visitors "
                "a year, most of them in summer. A new hall for electric trains opened on 1 June 2009.")

NAME_WIDTH = 34  # the table's row-name column: "draft, k=8 conf=0.3 (free)" and the like fit

def chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def run(engine, prompt: list[int], n: int) -> dict:
    from quantkit.engine import SamplingParams

    engine.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # warm-up
    engine.reset_metrics()
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    m = engine.get_metrics()
    steps = m["decode_steps"]
    return {"tokens": out["token_ids"], "decode_tokens_per_s": m["decode_tokens_per_s"],
            "step_ms": 1e3 * m["decode_time_s"] / steps if steps else None,
            **{k: m.get(k) for k in ("acceptance_rate", "mean_accepted_tokens", "per_token_acceptance",
                                     "draft_time_s", "verify_time_s", "speculative_steps")}}


def ensure_int4(workdir: Path, method: str, group_size: int, sym: bool) -> Path:
    """The demo's int4 checkpoint by `method` (made once per workdir; GPTQ takes ~4 min here)."""
    import quantkit

    out = workdir / f"demo-{method}-w4g{group_size}-{'sym' if sym else 'asym'}"
    if not (out / "config.json").is_file():
        print(f"[bench] quantizing the demo model to int4 ({out.name}) -> {out}", file=sys.stderr, flush=True)
        quantkit.quantize("demo", method, bits=4, group_size=group_size, sym=sym, output=str(out), progress=False,
                          overwrite=True)
    return out


def describe(path: Path) -> str:
    """A checkpoint's quantization scheme, from its config."""
    cfg = json.loads((path / "config.json").read_text()).get("quantization_config", {})
    return f"{path.name}: {cfg.get('bits')}-bit, group {cfg.get('group_size')}, " \
           f"{'symmetric' if cfg.get('sym', True) else 'asymmetric'}, {cfg.get('quant_method')} format"


def predicted(alpha: float, k: int, c: float) -> float:
    expected = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (k * c + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default=None, help="draft checkpoint (default: one made in --workdir by the next three)")
    ap.add_argument("--draft-method", default="gptq", help="rtn or gptq (default; its own default calibration)")
    ap.add_argument("--draft-group-size", type=int, default=32)
    ap.add_argument("--draft-sym", action="store_true", help="a symmetric grid (default: asymmetric, the demo's own "
                    "kind of grid, so it fits unusually well: see the module docstring)")
    ap.add_argument("--draft-dtype", default="float32", help="draft activations (the CPU decode kernels take fp32)")
    ap.add_argument("--draft-lm-head-quant", default="shortlist", help="the draft's LM head: shortlist, int8, int4 or none (a "
                    "cheaper draft step; the target's head is never quantized)")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--confidence-rows", default="5:0.3",
                    help="comma-separated k:threshold rows drafting up to k tokens with the draft stopping below "
                         "the threshold (draft_confidence); '' for none")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    import quantkit
    from quantkit.engine import LLMEngine
    from quantkit.runtime.loader import load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer("demo")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="qk-spec-"))
    draft_path = Path(args.draft) if args.draft else \
        ensure_int4(workdir, args.draft_method, args.draft_group_size, args.draft_sym)
    target = quantkit.load("demo", dtype="float32")
    draft = quantkit.load(str(draft_path), backend="cpu", dtype=args.draft_dtype)
    ks = [int(k) for k in args.ks.split(",")]
    N = args.new_tokens
    free, quote = chat_ids(tok, FREE_PROMPT), chat_ids(tok, QUOTE_PROMPT)
    blocks = -(-(max(len(free), len(quote)) + N + 16) // 16) + 2

    head = None if args.draft_lm_head_quant == "none" else args.draft_lm_head_quant

    def engine(model, **kw):
        return LLMEngine(model, tok, num_kv_blocks=blocks, max_num_seqs=1, enable_prefix_caching=False, **kw)

    rows = {"target alone (free)": (engine(target), free), "target alone (quote)": (engine(target), quote),
            "draft alone (free)": (engine(draft, lm_head_quant=head), free)}
    for k in ks:
        rows[f"draft, k={k} (free)"] = (engine(target, draft=draft, num_speculative_tokens=k, draft_tokenizer=tok,
                                               draft_lm_head_quant=head), free)
    confidence_rows = [(int(k), float(t)) for k, t in (r.split(":") for r in args.confidence_rows.split(",") if r)]
    for k, threshold in confidence_rows:
        rows[f"draft, k={k} conf={threshold:g} (free)"] = (
            engine(target, draft=draft, num_speculative_tokens=k, draft_tokenizer=tok, draft_lm_head_quant=head,
                   draft_confidence=threshold), free)
    for k in (2, 4):
        rows[f"ngram, k={k} (quote)"] = (engine(target, draft="ngram", num_speculative_tokens=k), quote)
        rows[f"ngram, k={k} (free)"] = (engine(target, draft="ngram", num_speculative_tokens=k), free)

    runs: dict[str, list[dict]] = {name: [] for name in rows}
    for r in range(args.rounds):
        for name, (eng, prompt) in rows.items():
            runs[name].append(run(eng, prompt, N))
            print(f"[bench] round {r + 1}: {name}: {runs[name][-1]['decode_tokens_per_s']:.1f} decode tok/s",
                  file=sys.stderr, flush=True)
    return report(runs, ks, args, draft_path, tok, len(free), len(quote))


def report(runs: dict, ks: list[int], args, draft_path, tok, free_len: int, quote_len: int) -> int:
    import torch

    med = lambda xs: statistics.median(xs)  # noqa: E731
    base = {"free": runs["target alone (free)"], "quote": runs["target alone (quote)"]}
    want = {key: runs[f"target alone ({key})"][0]["tokens"] for key in base}
    c_rounds = [d["step_ms"] / t["step_ms"] for d, t in zip(runs["draft alone (free)"], base["free"])]
    c = med(c_rounds)
    print(f"\ndemo model fp32 target, draft {describe(draft_path)} ({args.draft_dtype} activations, LM head "
          f"{args.draft_lm_head_quant}), {torch.get_num_threads()} "
          f"threads, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, batch 1, "
          f"{args.new_tokens} new tokens, prompts of {free_len} (free) / {quote_len} (quote) tokens, median of "
          f"{args.rounds} rounds; the machine is shared, per-round ratios below")
    print(f"target alone: {med([r['decode_tokens_per_s'] for r in base['free']]):.1f} decode tok/s "
          f"({med([r['step_ms'] for r in base['free']]):.1f} ms/step); draft alone: "
          f"{med([r['decode_tokens_per_s'] for r in runs['draft alone (free)']]):.1f} tok/s; "
          f"c = {c:.3f} (rounds: {' '.join(f'{x:.3f}' for x in c_rounds)})")
    head = f"{'':{NAME_WIDTH}s} {'tok/s':>7s} {'accept':>7s} {'alpha':>6s} {'tok/step':>8s} {'verify/tgt':>10s} " \
           f"{'draft/tgt':>9s} {'predicted':>9s} {'accounted':>9s} {'measured':>8s}  per-round speed-ups   same tokens"
    print(head)
    table = {"c": c, "c_rounds": c_rounds, "rows": {}}
    for name, rs in runs.items():
        if "target alone" in name or "draft alone" in name:
            continue
        key = "quote" if "(quote)" in name else "free"
        k = int(name.split("k=")[1].split(" ")[0])
        ups = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rs, base[key])]
        def in_target_steps(field: str) -> list[float]:  # a part of a speculative step, per round
            return [1e3 * r[field] / r["speculative_steps"] / b["step_ms"] for r, b in zip(rs, base[key])]

        verify, drafting = in_target_steps("verify_time_s"), in_target_steps("draft_time_s")
        alpha = med([r["per_token_acceptance"] or 0.0 for r in rs])
        tps = 1 + med([r["mean_accepted_tokens"] or 0.0 for r in rs])
        if "conf=" in name:  # a varying draft length: Leviathan's cost model with the measured draft tokens per step
            proposed = med([r["mean_accepted_tokens"] / r["acceptance_rate"] for r in rs if r["acceptance_rate"]])
            pred = tps / (proposed * c + 1)
        else:
            pred = predicted(alpha, k, 0.0 if name.startswith("ngram") else c)
        same = all(r["tokens"] == want[key] for r in rs)
        row = {"decode_tokens_per_s": med([r["decode_tokens_per_s"] for r in rs]), "acceptance_rate":
               med([r["acceptance_rate"] or 0.0 for r in rs]), "alpha": alpha, "tokens_per_step": tps,
               "verify_over_target_step": med(verify), "draft_over_target_step": med(drafting), "predicted": pred,
               "accounted": tps / (med(drafting) + med(verify)), "measured": med(ups), "speedups": ups,
               "same_tokens": same}
        table["rows"][name] = row
        print(f"{name:{NAME_WIDTH}s} {row['decode_tokens_per_s']:7.1f} {row['acceptance_rate']:7.3f} {alpha:6.3f} {tps:8.2f} "
              f"{row['verify_over_target_step']:10.2f} {row['draft_over_target_step']:9.2f} {pred:8.2f}x "
              f"{row['accounted']:8.2f}x {row['measured']:7.2f}x  "
              + " ".join(f"{x:4.2f}x" for x in ups) + f"   {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return 0 if all(r["same_tokens"] for r in table["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
