"""Shared fixtures. Triton kernels run under the interpreter here (no GPU on CI): set before import."""
import os

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    from quantkit.assets import demo_model_dir

    return Path(demo_model_dir())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, demo_dir) -> Path:
    """A 2-layer random Llama saved like a real HF folder, with the demo's tokenizer (so vocab matches)."""
    import transformers

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(out)
    return out


def run_cli(*args, cwd=None, env=None, timeout=900):
    """Run `python -m quantkit.cli ARGS` in a subprocess; returns CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "quantkit.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, "no stdout"
    return json.loads(lines[-1])


# Demo-model tests written at the end of session 1 that could not be run to completion there (the
# 2-core box was saturated); skipped visibly, with the reason, until a session verifies them.
UNVERIFIED = {
    "tests/test_gptq_demo.py::test_gptq_beats_rtn_act_order_no_worse_and_8bit_close",
    "tests/test_awq.py::test_demo_perplexity_awq_beats_rtn",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in UNVERIFIED:
            item.add_marker(pytest.mark.skip(reason="unverified slow demo test (session 1 ran out of time); see closing note"))
