#!/usr/bin/env python
"""llama.cpp's batch-1 greedy decode speed on a GGUF, for scripts/bench_decode.py's side-by-side row.

Runs under a Python that has llama-cpp-python (its own venv; quantkit is not imported): reads
``{"gguf", "prompt_ids", "new_tokens", "threads", "repeats"}`` as JSON on stdin, prefills the prompt
(not timed), then times ``new_tokens`` single-token evaluations with greedy (argmax) selection of
each next token, and prints ``{"decode_tokens_per_s": [one per repeat], "token_ids": [...]}`` as JSON.
One warm-up run comes first.
"""
from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import llama_cpp
    import numpy as np

    req = json.load(sys.stdin)
    prompt, n, threads = [int(t) for t in req["prompt_ids"]], int(req["new_tokens"]), int(req["threads"])
    llm = llama_cpp.Llama(model_path=req["gguf"], n_ctx=len(prompt) + n + 8, n_batch=max(32, len(prompt)),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        return int(logits.argmax())

    rates, tokens = [], []
    for r in range(int(req.get("repeats", 1)) + 1):
        llm.reset()
        llm.eval(prompt)  # prefill, not timed
        tok, out = next_token(), []
        t0 = time.perf_counter()
        for _ in range(n):
            out.append(tok)
            llm.eval([tok])
            tok = next_token()
        elapsed = time.perf_counter() - t0
        if r:  # the first run warms up
            rates.append(n / elapsed)
            tokens = out
    json.dump({"decode_tokens_per_s": rates, "token_ids": tokens, "llama_cpp": llama_cpp.__version__}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
