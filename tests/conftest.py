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


@pytest.fixture(scope="module")
def one_thread():
    """Small matmuls on a shared 2-core box: one thread avoids spin-wait contention (5x faster here).
    Modules of tiny-model tests use it (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    from quantkit.assets import demo_model_dir

    return Path(demo_model_dir())


class DemoBench:
    """The demo model (fp32), its tokenizer and held-out Lee tokens, loaded once per session for the
    slow quality tests, which fake-quantize copies of it through the real driver and score them on
    the same held-out windows (memoised: GPTQ's and AWQ's tests share the original and RTN scores)."""

    WINDOWS = 8  # held-out windows of 512 tokens (4096 tokens) per perplexity

    def __init__(self):
        from quantkit import data
        from quantkit.sources import load_source_model

        self.model, self.tok, *_ = load_source_model("demo", dtype=torch.float32)
        self.held_out = data.eval_token_stream("lee", self.tok)
        self._cache: dict = {}

    def perplexity(self, model) -> float:
        from quantkit.scoring import perplexity

        return perplexity(model, self.held_out, seq_len=512, max_windows=self.WINDOWS)["perplexity"]

    def kl(self, model) -> float:
        """Mean KL divergence of `model`'s next-token distribution from the original's, per token,
        on the same held-out windows (the original's side computed once, in memory)."""
        from quantkit.baseline_cache import in_memory_baseline
        from quantkit.scoring import compare, logits_of, windows_of

        windows = windows_of(self.held_out, 512, self.WINDOWS)
        if "baseline" not in self._cache:
            self._cache["baseline"] = in_memory_baseline(self.model, windows)
        return compare(logits_of(model), self._cache["baseline"], windows)["kl_mean"]

    def original(self) -> float:
        if "original" not in self._cache:
            self._cache["original"] = self.perplexity(self.model)
        return self._cache["original"]

    def quantized(self, quantizer, *, bits: int, group_size: int, sym: bool, samples: int, seq_len: int,
                  key=None, measure: str = "perplexity", seed: int = 0) -> float:
        """Held-out perplexity (or with measure="kl", mean KL to the original) of a fake-quantized copy;
        calibration from the Lee split."""
        import copy

        from quantkit import data
        from quantkit.api import linear_shapes
        from quantkit.pipeline import quantize_model
        from quantkit.models import get_adapter
        from quantkit.scheme import QuantScheme

        if key is not None and key in self._cache:
            return self._cache[key]
        m = copy.deepcopy(self.model)
        schemes = QuantScheme(bits=bits, group_size=group_size, sym=sym).resolve(linear_shapes(m))
        ids = data.calibration_batches("lee", self.tok, num_samples=samples, seq_len=seq_len, seed=seed)
        quantize_model(m, get_adapter(m), quantizer, schemes, ids, progress=False)
        ppl = self.kl(m) if measure == "kl" else self.perplexity(m)
        del m
        if key is not None:
            self._cache[key] = ppl
        return ppl

    def rtn(self, bits: int, group_size: int, sym: bool) -> float:
        from quantkit.quantizers import get_quantizer

        return self.quantized(get_quantizer("rtn"), bits=bits, group_size=group_size, sym=sym, samples=1, seq_len=8,
                              key=("rtn", bits, group_size, sym))


@pytest.fixture(scope="session")
def demo_bench() -> DemoBench:
    return DemoBench()


def save_tiny_llama(out: Path, demo_dir: Path, hidden: int = 64, intermediate: int = 128) -> Path:
    """A 2-layer random Llama (seed 0) saved in `out` like a real HF folder, with the demo's tokenizer (so
    vocab matches)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                   max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                                   eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, demo_dir) -> Path:
    """A 2-layer random Llama saved like a real HF folder, with the demo's tokenizer (so vocab matches)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), demo_dir)


@pytest.fixture(scope="session")
def tiny_llama_128_dir(tmp_path_factory, demo_dir) -> Path:
    """2 random Llama layers whose every input size divides W4AFP8's groups of 128 (the float presets' tests),
    with the demo tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"), demo_dir, hidden=128, intermediate=256)


def run_cli(*args, cwd=None, env=None, timeout=900):
    """Run `python -m quantkit.cli ARGS` in a subprocess; returns CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "quantkit.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, "no stdout"
    return json.loads(lines[-1])


def perturb_norms(model) -> None:
    """Random init leaves norm weights at exactly 1 (biases 0); perturb them so anything folded into
    a norm (AWQ, SmoothQuant scales) is really tested."""
    from torch import nn

    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm"):
                mod.weight.normal_(1.0, 0.2)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.normal_(0.0, 0.2)


def interrupt_after_first_layer(monkeypatch, run) -> None:
    """Runs `run()` (a quantize) stopped by KeyboardInterrupt right after layer 0's progress record is
    saved, as a Ctrl-C between layers would; the driver is as it was afterwards (for the --resume run)."""
    from quantkit.pipeline import driver

    persist = driver.LayerByLayer.persist

    def persist_then_stop(self, i, results, *rest):
        persist(self, i, results, *rest)
        raise KeyboardInterrupt

    monkeypatch.setattr(driver.LayerByLayer, "persist", persist_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(driver.LayerByLayer, "persist", persist)
