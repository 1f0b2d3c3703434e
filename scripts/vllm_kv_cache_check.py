"""By-hand check (not a test tier): does vLLM 0.32's CPU build load quantkit's kv_cache_scheme scales and run an
fp8 KV cache with them? Runs under .venv-vllm (imports vllm only). Three engines: the folder with scales at
kv_cache_dtype auto and fp8, the folder without scales at fp8; prints layer 0's _k_scale_float/_v_scale_float
and writes each run's top-20 prompt log-probs per position to out.json (compare them with a fourth run of the
folder without scales at auto for KL; see docs/support-matrix.md).

    .venv-vllm/bin/python scripts/vllm_kv_cache_check.py WITH_SCALES WITHOUT_SCALES windows.json out.json
(windows.json: a list of token-id lists)"""
import json, os, sys, time, gc, logging
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

with_scales, without, wfile, out = sys.argv[1:5]
windows = json.load(open(wfile))
res = {}
for name, path, kv in (("auto", with_scales, "auto"), ("fp8+scales", with_scales, "fp8"), ("fp8 no scales", without, "fp8")):
    t0 = time.time()
    try:
        llm = LLM(model=path, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=600, max_logprobs=20,
                  enforce_eager=True, seed=0, block_size=32)
        sp = SamplingParams(max_tokens=1, prompt_logprobs=20, temperature=0.0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], sp, use_tqdm=False)
        pos = [[{str(t): lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs[1:]] for o in outs]
        scales = None
        try:
            m = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
            a = m.model.layers[0].self_attn.attn
            scales = [getattr(a, "_k_scale_float", None), getattr(a, "_v_scale_float", None)]
        except Exception as e:
            scales = f"not read: {type(e).__name__}"
        res[name] = {"ok": True, "positions": pos, "layer0_scales": scales, "seconds": time.time() - t0}
        del llm; gc.collect()
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
        destroy_model_parallel(); destroy_distributed_environment()
    except Exception as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
    print(name, {k: v for k, v in res[name].items() if k != "positions"}, flush=True)
json.dump(res, open(out, "w"))
