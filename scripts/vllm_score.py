#!/usr/bin/env python
"""Score checkpoint folders with vLLM: prompt log-probabilities on given token windows.

Why this exists: quantkit's checkpoints are meant to be served by vLLM, so the vLLM test tier
(tests/test_vllm.py, `pytest -m vllm`) loads every layout quantkit writes in vLLM itself, unmodified,
and compares vLLM's next-token distributions with quantkit's own loader on the same tokens.
vLLM's pins clash with quantkit's, so this runs under the venv that scripts/setup_vllm_venv.sh builds
(.venv-vllm/bin/python) and imports only the standard library and vllm, never quantkit.

Input (a JSON file, argv[1]):
    {"windows": [[token ids], ...], "top_k": 20,
     "models": [{"name": "...", "path": "/abs/folder", "dtype": "bfloat16"}, ...]}
Output (a JSON file, argv[2]), per model name:
    {"ok": true, "seconds": s, "positions": [[[token id, ...], [logprob, ...]], ...]}   (top_k per scored
    position, in window order, every position after each window's first), or
    {"ok": false, "error": "<the first line vLLM raised>"} when vLLM refuses the folder.
Several folders are scored in one process to pay vLLM's start-up once.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: one process, no workers
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the windows are short
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _first_line(e: BaseException) -> str:
    """The line that says why: pydantic wraps vLLM's own ValueError under a generic first line."""
    lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
    for line in lines[1:]:
        if line.startswith("Value error,"):
            return line[len("Value error,"):].split(" [type=")[0].strip()[:500]
    return " ".join(lines)[:1000]  # vLLM lists its reasons on the lines after the first


def _release(llm) -> None:
    """Drop one engine so the next folder starts clean in the same process."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def score(model: dict, windows: list[list[int]], top_k: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    max_len = max(len(w) for w in windows) + 8
    llm = LLM(model=model["path"], dtype=model.get("dtype", "bfloat16"), max_model_len=max_len,
              max_logprobs=top_k, enforce_eager=True, seed=0, trust_remote_code=False)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
        positions = []
        for out in outs:
            for entry in out.prompt_logprobs[1:]:  # the first prompt token has no prediction
                best = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top_k]
                positions.append([[int(t) for t, _ in best], [float(lp.logprob) for _, lp in best]])
    finally:
        _release(llm)
    return {"ok": True, "seconds": time.perf_counter() - t0, "positions": positions}


def main() -> int:
    request = json.loads(open(sys.argv[1]).read())
    results = {}
    for model in request["models"]:
        try:
            results[model["name"]] = score(model, request["windows"], int(request.get("top_k", 20)))
        except Exception as e:  # a refused folder is a result to report, not a crash of the run
            traceback.print_exc(file=sys.stderr)
            results[model["name"]] = {"ok": False, "error": _first_line(e)}
        gc.collect()
        print(f"vllm_score: {model['name']}: " + ("ok" if results[model["name"]]["ok"]
                                                  else results[model["name"]]["error"]), file=sys.stderr, flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
