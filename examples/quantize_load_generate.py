"""Quantize, load the packed checkpoint, and generate text with it.

RTN needs no calibration data, so this is the quickest round trip: quantize to 4-bit groups of 64,
load the folder with quantkit.load (a transformers model whose linears run from the packed int4
weights), and answer a chat prompt with transformers' generate. The folder also loads in vLLM
and, for gptq/awq/compressed-tensors, in transformers itself.

    python examples/quantize_load_generate.py                  # the bundled demo model
    python examples/quantize_load_generate.py --model ./my-hf-folder --prompt "Hello"
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
import transformers

import quantkit


def main(stack: contextlib.ExitStack) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a Hugging Face model folder, or 'demo'")
    ap.add_argument("--output", default=None, help="where to write (default: a temporary folder, removed at the end)")
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    scratch = args.output or stack.enter_context(tempfile.TemporaryDirectory(prefix="quantkit-generate-"))
    output = Path(scratch) / "rtn-w4g64"
    result = quantkit.quantize(args.model, "rtn", bits=4, group_size=64, output=output, overwrite=True,
                               progress=False)
    print(f"wrote {result.output}: {result['quantized_linears']} linears at {result['bits']} bits")

    model = quantkit.load(result.output, backend="auto")
    tokenizer = transformers.AutoTokenizer.from_pretrained(result.output)
    packed = sum(type(m).__name__ == "QuantLinear" for m in model.modules())
    print(f"loaded with {packed} packed linears")

    messages = [{"role": "user", "content": args.prompt}]
    prompt = (tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
              if tokenizer.chat_template else args.prompt)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"prompt: {args.prompt}\nanswer: {answer.strip()}")


if __name__ == "__main__":
    with contextlib.ExitStack() as cleanup:
        main(cleanup)
