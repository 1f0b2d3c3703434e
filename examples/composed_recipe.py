"""A composed recipe: AWQ's activation-aware scales, then GPTQ, calibrated on chat conversations.

The recipe is YAML (here written from Python so the script is self-contained; a file under
version control is the usual home). Its steps run in order on each decoder layer: the AWQ
transform searches and folds per-channel scales, then the GPTQ quantizer solves the scaled
layer's 4-bit weights. The calibration data is a list of conversations, rendered with the
tokenizer's chat template, which overrides the recipe's dataset. The result is then scored
against the original model (KL divergence per token on held-out text).

    python examples/composed_recipe.py                     # the bundled demo model
    python examples/composed_recipe.py --model ./my-hf-folder

The same run without a file: quantkit.quantize(model, ["awq", "gptq"], bits=4, group_size=64,
options={"n_grid": 10}, dataset=conversations, ...).
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import yaml

import quantkit

RECIPE = {
    "method": ["awq", "gptq"],  # transforms first, then one weight quantizer
    "format": "gptq",
    "scheme": {"bits": 4, "group_size": 64, "sym": True},
    "options": {"n_grid": 10, "damp_percent": 0.01},  # each option goes to the step that declares it
    "calibration": {"num_samples": 8, "seq_len": 128, "seed": 0},
}

QUESTIONS = ["How do I boil an egg so the yolk stays soft?", "What is the capital of Australia?",
             "Explain photosynthesis to a ten-year-old.", "Write a haiku about autumn rain.",
             "How many minutes are there in a week?", "Why is the sky blue during the day?",
             "Give me three tips for a job interview.", "What does a compiler do?",
             "Summarise the plot of Romeo and Juliet in two sentences.", "How do vaccines train the immune system?"]


def conversations() -> list[list[dict]]:
    """Stand-in for your own chat logs: user turns with short assistant answers."""
    return [[{"role": "user", "content": q},
             {"role": "assistant", "content": f"Here is a short answer to '{q}' with the key facts, step by step, "
                                              "and a note on what to check if it does not work the first time."}]
            for q in QUESTIONS * 4]


def main(stack: contextlib.ExitStack) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a Hugging Face model folder, or 'demo'")
    ap.add_argument("--output", default=None, help="where to write (default: a temporary folder, removed at the end)")
    args = ap.parse_args()
    scratch = args.output or stack.enter_context(tempfile.TemporaryDirectory(prefix="quantkit-recipe-"))
    work = Path(scratch)
    work.mkdir(parents=True, exist_ok=True)
    recipe_file = work / "awq-gptq-w4g64.yaml"
    recipe_file.write_text(yaml.safe_dump(RECIPE, sort_keys=False))

    result = quantkit.quantize(args.model, recipe=recipe_file, dataset=conversations(), output=work / "awq-gptq",
                               overwrite=True, progress=False)
    plan = result.plan
    print(f"steps: {' -> '.join(step.name for step in plan.recipe.steps)}; "
          f"{plan.scheme.bits}-bit, group {plan.scheme.group_size}, format {plan.format}")
    print(f"calibration: {plan.calibration.label()}")
    report = quantkit.evaluate(result.output, baseline=args.model, seq_len=256, max_windows=4, baseline_cache=False)
    print(f"KL to the original: {report['kl_mean']:.4f} per token (top-1 agreement {report['top1_agreement']:.3f}, "
          f"perplexity {report['perplexity']:.2f} against {report['baseline_perplexity']:.2f})")


if __name__ == "__main__":
    with contextlib.ExitStack() as cleanup:
        main(cleanup)
