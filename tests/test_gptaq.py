"""GPTAQ: GPTQ towards the unquantized model's outputs, from the quantized model's inputs."""
import copy

import pytest
import torch

from quantkit.quantizers.gptq_core import CrossAccumulator, HessianAccumulator, asymmetric_target, gptq_quantize


def _problem(seed=0, rows=2000, k=48, n=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.2, 3, k)  # uneven channels
    # the unquantized model's input differs, mostly as a function of the quantized one (as an earlier
    # layer's quantization error is), partly not
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x_ref = x + 0.3 * x @ mix + 0.05 * torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    return x, x_ref, w


def _stats(x, x_ref):
    H, D = HessianAccumulator(x.shape[1]), CrossAccumulator(x.shape[1])
    for part in range(0, x.shape[0], 500):  # in batches, as calibration sees them
        H.add_batch(x[part:part + 500])
        D.add_batch(x[part:part + 500], x_ref[part:part + 500])
    return H.hessian(), D.cross()


def test_the_target_is_the_least_squares_solution_of_the_asymmetric_problem():
    """Unquantized, min ||x Q^T - x_ref W^T|| has the closed form W + W D H^-1; checked against lstsq."""
    x, x_ref, w = _problem()
    H, D = _stats(x, x_ref)
    target = asymmetric_target(w, H, D, alpha=1.0, damp_percent=1e-9)
    oracle = torch.linalg.lstsq(x.double(), (x_ref.double() @ w.double().t())).solution.t()
    torch.testing.assert_close(target.double(), oracle, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(D, 2 * (x_ref - x).t() @ x / x.shape[0], rtol=1e-4, atol=1e-4)


def test_gptq_on_the_target_reproduces_the_unquantized_output_better():
    x, x_ref, w = _problem(seed=1)
    H, D = _stats(x, x_ref)
    error = lambda q: float((x @ q.t() - x_ref @ w.t()).square().sum())  # noqa: E731
    plain, _ = gptq_quantize(w, H, bits=4, group_size=16, sym=True)
    aware, _ = gptq_quantize(asymmetric_target(w, H, D, 1.0, 0.01), H, bits=4, group_size=16, sym=True)
    # measured over seeds 0-3: 0.09-0.10x of plain GPTQ's error against the unquantized output
    assert error(aware.dequantize()) < 0.3 * error(plain.dequantize())


@pytest.mark.slow  # ~7 CPU s
def test_pipeline_feeds_the_unquantized_models_inputs_as_reference(tiny_llama_dir):
    """With gptaq the recipe observes, beside each linear's input, the same rows' input in the
    unquantized model: at layer 1 that is what an untouched copy of the model gives there."""
    import transformers

    from quantkit.api import linear_shapes
    from quantkit.models import get_adapter
    from quantkit.pipeline import quantize_model
    from quantkit.quantizers.gptq import GPTQQuantizer
    from quantkit.scheme import QuantScheme

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    want = {}
    hook = original.model.layers[1].self_attn.q_proj.register_forward_pre_hook(
        lambda m, args: want.setdefault("x", args[0].detach().clone()))
    with torch.no_grad():
        original(ids)
    hook.remove()

    class Spy(GPTQQuantizer):
        seen = {}

        def observe(self, name, module, x, reference=None):
            if name == "self_attn.q_proj":
                self.seen.setdefault(self._ctx.index, []).append((x.detach().clone(), reference.detach().clone()))
            super().observe(name, module, x, reference=reference)

    schemes = QuantScheme(bits=4, group_size=32).resolve(linear_shapes(model))
    spy = Spy(gptaq=True)
    results = quantize_model(model, get_adapter(model), spy, schemes, ids, batch_size=2, progress=False)
    x1, ref1 = (torch.cat(t) for t in zip(*spy.seen[1]))
    torch.testing.assert_close(ref1, want["x"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(x1, ref1, atol=1e-3)  # layer 0 quantized: the two streams differ
    plain = quantize_model(copy.deepcopy(original), get_adapter(model), GPTQQuantizer(), schemes, ids, batch_size=2,
                           progress=False)
    changed = [n for n in results if not torch.equal(results[n].qweight, plain[n].qweight)]
    assert any(".layers.1." in n for n in changed)


def test_gptaq_resumes_to_the_uninterrupted_result(tiny_llama_dir, tmp_path, monkeypatch):
    import quantkit
    from conftest import interrupt_after_first_layer

    kwargs = dict(bits=4, group_size=32, num_samples=4, seq_len=16, options={"gptaq": True}, progress=False)
    whole = quantkit.quantize(str(tiny_llama_dir), "gptq", output=tmp_path / "whole", **kwargs)
    interrupt_after_first_layer(
        monkeypatch, lambda: quantkit.quantize(str(tiny_llama_dir), "gptq", output=tmp_path / "resumed", **kwargs))
    quantkit.quantize(str(tiny_llama_dir), "gptq", output=tmp_path / "resumed", resume=True, **kwargs)
    a, b = (tmp_path / d / "model.safetensors" for d in ("whole", "resumed"))
    assert a.read_bytes() == b.read_bytes()
