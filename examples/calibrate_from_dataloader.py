"""Calibrate GPTQ on your own data: an in-memory transformers model and a torch DataLoader.

This is the workflow of llm-compressor's ``oneshot(model=obj, dataset=...)`` and GPTQModel's
``model.quantize(calibration_dataset)``: you hold the model and a DataLoader of tokenized batches
(padded, with their attention masks). quantkit drops the padding, packs the real tokens into
windows, calibrates a copy of the model (yours is left untouched) and writes a packed checkpoint.

    python examples/calibrate_from_dataloader.py                  # the bundled demo model
    python examples/calibrate_from_dataloader.py --model ./my-hf-folder --output ./my-gptq
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader

import quantkit
from quantkit.sources import resolve_model_path

TOPICS = ["a late train", "a broken laptop screen", "a refund for a double charge", "a lost parcel",
          "a password reset", "a noisy neighbour", "a delayed flight", "a wrong pizza order"]


def support_tickets() -> list[str]:
    """Stand-in for your own domain text: short customer-support exchanges."""
    return [f"Customer: Hello, I am writing about {topic}. It happened on day {day} and nobody has answered yet.\n"
            f"Agent: I am sorry about {topic}. I have opened case {1000 + 37 * day} and will reply within "
            f"{day % 3 + 1} working days with the next steps."
            for day, topic in enumerate(TOPICS * 3, start=1)]


def main(stack: contextlib.ExitStack) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a Hugging Face model folder, or 'demo'")
    ap.add_argument("--output", default=None, help="where to write (default: a temporary folder, removed at the end)")
    args = ap.parse_args()

    folder = resolve_model_path(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)  # your model, in memory

    encoded = tokenizer(support_tickets(), padding="max_length", truncation=True, max_length=96,
                        return_tensors="pt")
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(encoded["input_ids"], encoded["attention_mask"])]
    loader = DataLoader(rows, batch_size=4)  # batches of {"input_ids": [4, 96], "attention_mask": [4, 96]}

    before = model.model.layers[0].mlp.down_proj.weight.clone()
    scratch = args.output or stack.enter_context(tempfile.TemporaryDirectory(prefix="quantkit-dataloader-"))
    output = Path(scratch) / "gptq-w4"
    result = quantkit.quantize(model, "gptq", tokenizer=tokenizer, dataset=loader, bits=4, group_size=64,
                               output=output, overwrite=True, progress=False)

    c = result.plan.calibration
    print(f"wrote {result.output} in {result['seconds']:.1f} s")
    print(f"calibrated on {c.num_samples} x {c.seq_len} tokens from: {c.label()}")
    print(f"calibration tokens sha256 (also on the model card): {c.tokens_sha256}")
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, before), "the model passed in was modified"
    print("the in-memory model passed in is unchanged")


if __name__ == "__main__":
    with contextlib.ExitStack() as cleanup:
        main(cleanup)
