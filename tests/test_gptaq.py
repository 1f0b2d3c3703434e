"""GPTAQ: GPTQ towards the unquantized model's outputs, from the quantized model's inputs."""
import copy

import pytest
import torch
from tiny_models import tiny_model

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


def test_the_cross_term_drops_the_rows_the_hessian_drops():
    """A row with NaN/inf in the quantized input leaves both statistics, one whose reference is not
    finite the cross term; the others give the plain formula's D (checked past the one-read check
    that lets a clean batch skip the row mask, and equal to that clean batch's own D)."""
    x, x_ref, _ = _problem(rows=300)
    x[7, 3], x_ref[20, 0], x[41, 5] = float("nan"), float("inf"), float("-inf")
    H, D = HessianAccumulator(x.shape[1]), CrossAccumulator(x.shape[1])
    with pytest.warns(RuntimeWarning, match="dropped 2 of 300"):
        H.add_batch(x)
    D.add_batch(x, x_ref)
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    keep[[7, 20, 41]] = False
    xk, rk = x[keep].double(), x_ref[keep].double()
    assert D.n_samples == 297 and H.n_samples == 298  # x's row 20 is finite: only its reference is not
    torch.testing.assert_close(D.cross().double(), 2 * (rk - xk).t() @ xk / 297, rtol=1e-5, atol=1e-6)
    clean = CrossAccumulator(x.shape[1])
    clean.add_batch(x[keep], x_ref[keep])
    assert torch.equal(clean.cross(), D.cross())


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


def _staged_gptaq():
    """GPTAQ forced onto the stage-by-stage driver (a partial forward of the unquantized layer per stage and batch)."""
    from quantkit.quantizers.gptq import GPTQQuantizer

    class Staged(GPTQQuantizer):
        def quantize_in_forward(self):
            return False

    return Staged(gptaq=True)


def _gptaq_both_ways(model, ids, monkeypatch):
    """(staged results, one-pass results, the two models), checking that the one-pass run captured each
    unquantized layer's stage inputs in one forward of its own and the staged run in none."""
    from quantkit.api import linear_shapes
    from quantkit.models import get_adapter
    from quantkit.pipeline import quantize_model
    from quantkit.pipeline import one_pass as one_pass_module
    from quantkit.quantizers.gptq import GPTQQuantizer
    from quantkit.scheme import QuantScheme

    captures = []
    capture = one_pass_module.OnePassStrategy.capture_references
    monkeypatch.setattr(one_pass_module.OnePassStrategy, "capture_references",
                        lambda self, ctx, *a: (captures.append(ctx.index), capture(self, ctx, *a))[1])
    schemes = QuantScheme(bits=4, group_size=32).resolve(linear_shapes(model))
    staged_model, one_pass_model = copy.deepcopy(model), copy.deepcopy(model)
    staged = quantize_model(staged_model, get_adapter(model), _staged_gptaq(), schemes, ids,
                            batch_size=ids.shape[0], progress=False)
    assert captures == []
    one_pass = quantize_model(one_pass_model, get_adapter(model), GPTQQuantizer(gptaq=True), schemes, ids,
                              batch_size=ids.shape[0], progress=False)
    assert captures == list(range(model.config.num_hidden_layers)), captures  # one forward of each unquantized layer
    return staged, one_pass, staged_model, one_pass_model


@pytest.mark.parametrize("attention_chunks", [False, True], ids=["whole", "attention-per-sequence"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "opt", "phi3"])
def test_one_pass_gptaq_gives_the_staged_results_exactly(model_type, attention_chunks, monkeypatch):
    """With one calibration batch GPTAQ runs in the one-pass strategy: one forward of the unquantized
    layer records every stage's input (and gives the unquantized stream's next input), then the
    quantizing forward hands each observed row its reference row. It must be the staged computation
    (a partial forward of both layers per stage): the same integers, scales, logits. With
    `attention_chunks` the attention runs one sequence at a time and the norms one row at a time in
    both forwards (the scratch buffers they share must not leak into the recorded references)."""
    from quantkit.pipeline import chunked

    if attention_chunks:
        monkeypatch.setattr(chunked, "ATTN_CHUNK_BYTES", 1)
        monkeypatch.setattr(chunked, "NORM_CHUNK_BYTES", 1)
    model = tiny_model(model_type)
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    staged, one_pass, staged_model, one_pass_model = _gptaq_both_ways(model, ids, monkeypatch)
    assert list(one_pass) == list(staged)
    for name in staged:
        for field in ("qweight", "scales", "zeros"):
            assert torch.equal(getattr(one_pass[name], field), getattr(staged[name], field)), (name, field)
    with torch.no_grad():
        assert torch.equal(one_pass_model(ids).logits, staged_model(ids).logits)


def test_one_pass_gptaq_pairs_the_chunked_mlps_rows(monkeypatch):
    """With more tokens than an MLP chunk, down's input reaches the observers chunk by chunk in both
    forwards; each chunk must meet the reference rows of the same tokens. Against the staged driver:
    layer 0's linears before down identical, down's cross term equal to rounding (a pairing off by one
    chunk would change it entirely), everything after within rounding."""
    from quantkit.pipeline import chunked
    from quantkit.quantizers import gptq_core

    monkeypatch.setattr(chunked, "MLP_CHUNK_BYTES", 24 * 128 * 4)  # 24 rows of the fp32 [*, 128] gate
    monkeypatch.setattr(chunked, "MLP_CHUNK_MIN_ROWS", 1)
    crosses, observed_rows = [], []  # down_proj's cross terms as the solves read them (staged run first); its row chunks
    cross, observe = gptq_core.CrossAccumulator.cross, gptq_core.CrossAccumulator.add_batch

    def recording_cross(self):
        d = cross(self)
        if self.in_features == 128:
            crosses.append(d.clone())
        return d

    def recording_observe(self, x, reference):
        if self.in_features == 128:
            observed_rows.append(x.numel() // 128)
        observe(self, x, reference)

    monkeypatch.setattr(gptq_core.CrossAccumulator, "cross", recording_cross)
    monkeypatch.setattr(gptq_core.CrossAccumulator, "add_batch", recording_observe)
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    staged, one_pass, staged_model, one_pass_model = _gptaq_both_ways(model, ids, monkeypatch)
    # staged: the whole batch per layer; one pass: 16-row chunks (each 32-token sequence in two)
    assert observed_rows == [256, 256] + [16] * 32, observed_rows
    assert len(crosses) == 4 and float(crosses[0].abs().max()) > 0
    torch.testing.assert_close(crosses[2], crosses[0], rtol=1e-4, atol=1e-6 * float(crosses[0].abs().max()))
    for name in staged:
        qa, qb = one_pass[name], staged[name]
        if ".layers.0." in name and not name.endswith("down_proj"):
            assert torch.equal(qa.qweight, qb.qweight) and torch.equal(qa.scales, qb.scales), name
        else:
            assert (qa.qweight != qb.qweight).float().mean() < 0.005, name
            torch.testing.assert_close(qa.scales, qb.scales, rtol=1e-3, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(one_pass_model(ids).logits, staged_model(ids).logits, rtol=0, atol=1e-4)
