"""KL divergence, top-1 agreement and perplexity against a baseline, checked against plain PyTorch."""
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

SEQ = 32


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "baselines"


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama with sharpened logits (baseline) and a perturbed copy (the 'quantized' model)."""
    import transformers

    base, other = tmp_path_factory.mktemp("tiny-base"), tmp_path_factory.mktemp("tiny-perturbed")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        model.model.norm.weight.mul_(40)  # random init gives near-uniform next-token distributions
        model.save_pretrained(base)
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(0.5 * p.std() * torch.randn_like(p))
    model.save_pretrained(other)
    for d in (base, other):
        tokenizer.save_pretrained(d)
    return base, other


def token_stream(n_windows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n_windows * SEQ,), generator=torch.Generator().manual_seed(seed))


def oracle(base_dir, model_dir, stream: torch.Tensor) -> dict:
    """The same statistics written out in plain PyTorch/numpy from transformers' own forwards."""
    import transformers

    windows = stream.reshape(-1, SEQ)
    lps = []
    for d in (base_dir, model_dir):
        m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            lps.append(torch.log_softmax(m(input_ids=windows).logits[:, :-1].double(), -1))
    base, ours = lps
    kl = (base.exp() * (base - ours)).sum(-1).flatten().numpy()
    targets = windows[:, 1:]
    nll = lambda lp: -lp.gather(-1, targets[..., None]).mean().item()  # noqa: E731
    # per window: mean KL and mean NLL gap; their standard errors over the windows
    gap = (base - ours).gather(-1, targets[..., None]).squeeze(-1).numpy()  # NLL(model) - NLL(baseline)
    kl_w, gap_w = kl.reshape(windows.shape[0], -1).mean(1), gap.mean(1)
    stderr = lambda v: np.std(v, ddof=1) / np.sqrt(v.size)  # noqa: E731
    return {"kl_mean": kl.mean(), "kl_p99": np.percentile(kl, 99),
            "top1_agreement": (base.argmax(-1) == ours.argmax(-1)).double().mean().item(),
            "perplexity": np.exp(nll(ours)), "baseline_perplexity": np.exp(nll(base)), "tokens": kl.size,
            "kl_mean_stderr": stderr(kl_w), "ln_ppl_ratio": gap.mean(), "ln_ppl_ratio_stderr": stderr(gap_w),
            "window_kl": kl_w, "window_ln_ppl_ratio": gap_w}


def check(result: dict, expected: dict) -> None:
    assert result["tokens"] == expected["tokens"]
    for key in ("kl_mean", "kl_p99", "perplexity", "baseline_perplexity", "kl_mean_stderr", "ln_ppl_ratio",
                "ln_ppl_ratio_stderr"):
        assert result[key] == pytest.approx(expected[key], rel=1e-4), key
    assert result["ln_ppl_ratio"] == pytest.approx(np.log(result["perplexity"] / result["baseline_perplexity"]), rel=1e-6)
    for key in ("window_kl", "window_ln_ppl_ratio"):
        np.testing.assert_allclose(result[key], expected[key], rtol=1e-4, atol=1e-7, err_msg=key)
    assert result["top1_agreement"] == pytest.approx(expected["top1_agreement"], abs=1e-9)


def test_kl_and_top1_match_plain_pytorch_and_the_cache_serves_the_second_eval(pair, cache):
    import quantkit

    base_dir, model_dir = pair
    stream = token_stream(6)
    expected = oracle(base_dir, model_dir, stream)
    assert 0.01 < expected["kl_mean"] and expected["top1_agreement"] < 0.99  # the perturbation is visible
    first = quantkit.evaluate(model_dir, baseline=str(base_dir), dataset=stream, seq_len=SEQ, batch_size=4)
    check(first, expected)
    assert first["baseline_cache"] == "miss" and len(list(cache.glob("*.safetensors"))) == 1
    again = quantkit.evaluate(model_dir, baseline=str(base_dir), dataset=stream, seq_len=SEQ, batch_size=4)
    assert again["baseline_cache"] == "hit"
    check(again, expected)
    # the model against itself: zero divergence, full agreement
    same = quantkit.evaluate(base_dir, baseline=str(base_dir), dataset=stream, seq_len=SEQ)
    assert same["baseline_cache"] == "hit" and abs(same["kl_mean"]) < 1e-6 and same["top1_agreement"] == 1.0


def test_a_change_of_data_window_or_baseline_misses_the_cache(pair, cache, tmp_path):
    import transformers

    import quantkit

    base_dir, model_dir = pair
    stream = token_stream(4)
    assert quantkit.evaluate(model_dir, baseline=str(base_dir), dataset=stream, seq_len=SEQ)["baseline_cache"] == "miss"
    other_data = token_stream(4, seed=5)
    assert quantkit.evaluate(model_dir, baseline=str(base_dir), dataset=other_data, seq_len=SEQ)["baseline_cache"] == "miss"
    assert quantkit.evaluate(model_dir, baseline=str(base_dir), dataset=stream, seq_len=SEQ // 2)["baseline_cache"] == "miss"
    # a baseline folder whose weights were rewritten is a new baseline
    changed = tmp_path / "changed-base"
    shutil.copytree(base_dir, changed)
    first = quantkit.evaluate(model_dir, baseline=str(changed), dataset=stream, seq_len=SEQ)
    m = transformers.AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32)
    with torch.no_grad():
        m.model.norm.weight.mul_(1.5)
    m.save_pretrained(changed)
    second = quantkit.evaluate(model_dir, baseline=str(changed), dataset=stream, seq_len=SEQ)
    assert (first["baseline_cache"], second["baseline_cache"]) == ("miss", "miss")
    check(second, oracle(changed, model_dir, stream))
    assert second["kl_mean"] != pytest.approx(first["kl_mean"], rel=1e-3)
    off = quantkit.evaluate(model_dir, baseline=str(changed), dataset=stream, seq_len=SEQ, baseline_cache=False)
    assert off["baseline_cache"] == "off"
    check(off, oracle(changed, model_dir, stream))


class ScaledHead(nn.Module):
    """A model whose logits are not its head's output (soft-capping/scaling): must not be cached."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 8), nn.Linear(8, 11, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=30 * torch.tanh(self.head(self.embed(input_ids)) / 30) * 2)


def test_a_head_that_is_not_the_logits_is_scored_live(tmp_path):
    from quantkit.baseline_cache import baseline_logits

    torch.manual_seed(0)
    model = ScaledHead()
    windows = torch.randint(0, 11, (3, 5))
    base = baseline_logits(lambda: model, tmp_path, windows, {"device": None}, tmp_path / "cache")
    assert base.cache == "off" and not (tmp_path / "cache").exists()
    torch.testing.assert_close(base(1, windows[1:3]), model(windows[1:3]).logits)


def test_evaluate_is_callable_again_in_one_process(pair):
    import quantkit

    base_dir, _ = pair
    stream = token_stream(2)
    a = quantkit.evaluate(base_dir, dataset=stream, seq_len=SEQ)
    b = quantkit.evaluate(base_dir, dataset=stream, seq_len=SEQ)
    assert a["perplexity"] == b["perplexity"] and a["baseline_perplexity"] is None
    assert callable(quantkit.evaluate)


def test_quantize_eval_records_kl_in_the_summary_and_the_card(pair, cache, tmp_path):
    import quantkit

    base_dir, _ = pair
    out = tmp_path / "rtn"
    summary = quantkit.quantize(str(base_dir), "rtn", bits=4, group_size=32, output=out, eval_after=True, progress=False)
    metrics = summary["metrics"]
    assert metrics["kl_mean"] > 0 and 0 < metrics["top1_agreement"] <= 1
    direct = quantkit.evaluate(out, baseline=str(base_dir), dataset="lee")
    assert direct["baseline_cache"] == "hit" and direct["kl_mean"] == pytest.approx(metrics["kl_mean"], rel=1e-6)
    card = (out / "README.md").read_text()
    assert "KL divergence to the original (mean per token)" in card and "lee (held-out split)" in card
