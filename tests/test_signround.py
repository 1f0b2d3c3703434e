"""Sign-gradient rounding (quantkit.quantizers.signround) after GPTQ / GPTAQ, on tiny models.

The start state must be the quantizer's solution bit for bit; the step must lower the layer-output
error on calibration rows it never stepped on; and, like every step, its two-rank and resumed runs
must write the bytes of one uninterrupted process.
"""
from __future__ import annotations

import pytest
import torch

from conftest import interrupt_after_first_layer
from test_robustness import tree_sha256
from tiny_models import tiny_model

from quantkit.errors import QuantkitError
from quantkit.models import get_adapter
from quantkit.pipeline.driver import quantize_model
from quantkit.quantizers.recipe import build_recipe
from quantkit.quantizers.signround import SignRoundRefiner, TunedLinear
from quantkit.scheme import LinearScheme


def _quantize(method: str, options: dict, seed: int = 1, n: int = 24, seq: int = 32):
    """The tiny Llama quantized by `method`; returns (recipe, results, model, calibration ids)."""
    model = tiny_model("llama")
    adapter = get_adapter(model)
    schemes = {f"model.layers.{i}.{name}": LinearScheme(bits=4, group_size=32, sym=True)
               for i, layer in enumerate(adapter.decoder_layers(model)) for name in adapter.linear_names(layer)}
    ids = torch.randint(2, 256, (n, seq), generator=torch.Generator().manual_seed(seed))
    recipe = build_recipe(method, options)
    results = quantize_model(model, adapter, recipe, schemes, ids, batch_size=5, progress=False)
    return recipe, results, model, ids


@pytest.mark.parametrize("act_order", [True, False])
def test_the_start_state_is_the_quantizers_solution_bit_for_bit(act_order):
    """V = 0, a = 1 give back GPTQ's codes and scales, and its dequantized weight, exactly (with act-order
    and static groups, and without act-order)."""
    _, results, model, _ = _quantize("gptq", {"desc_act": act_order, "mse": True})
    reference = tiny_model("llama")  # the same seed: the unquantized weights
    for name, qw in results.items():
        weight = reference.get_submodule(name).weight
        start = TunedLinear.start_from(name, qw, weight, "cpu")
        out = start.result(start.factor, start.offset)
        assert torch.equal(out.qweight, qw.qweight) and torch.equal(out.scales, qw.scales)
        with torch.no_grad():
            assert torch.equal(start.dequantized(start.factor, start.offset), qw.dequantize())


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_returns_the_weights_it_rounded_and_the_rounded_start_reproduces_its_codes(act_order):
    """gptq_quantize(return_rounded=True): rounding those weights to nearest on the result's own grid
    (plain torch: scale and zero of each column's group) gives GPTQ's codes exactly; the first column
    GPTQ processes had no earlier error to take, so it is the unquantized column; the later ones were
    moved. TunedLinear's "rounded" start reproduces the codes and sits where they lie inside the bins."""
    from quantkit.quantizers.gptq_core import gptq_quantize

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 128, generator=gen)
    x = torch.randn(512, 128, generator=gen) @ (torch.eye(128) + 0.3 * torch.randn(128, 128, generator=gen))
    qw, stats = gptq_quantize(weight, x.t() @ x, bits=4, group_size=32, sym=True, act_order=act_order,
                              static_groups=act_order, mse=True, return_rounded=True)
    rounded = stats["rounded"]
    cols = qw.g_idx.long()
    scale, zero = qw.scales[:, cols], qw.zeros[:, cols].float()
    assert torch.equal(torch.clamp(torch.round(rounded / scale) + zero, 0, 15).to(torch.uint8), qw.qweight)
    first = int(torch.argmax(torch.diagonal(x.t() @ x))) if act_order else 0
    assert torch.equal(rounded[:, first], weight[:, first])
    assert not torch.equal(rounded, weight)
    start = TunedLinear.start_from("w", qw, weight, "cpu", "rounded", rounded)
    assert torch.equal(start.result(start.factor, start.offset).qweight, qw.qweight)
    inside = ((rounded / scale) - torch.round(rounded / scale)).clamp(-0.499, 0.499)
    assert torch.allclose(start.start - (qw.qweight.float() - zero), inside, rtol=0, atol=1e-6)


HELD_OUT = [8 * k + 7 for k in range(8)]  # 64 sequences: the last of each of the 8 shards is held out


def _layer0_error(results: dict, rows: torch.Tensor) -> float:
    """Layer 0's mean squared output error on `rows`, by transformers' own forward: the unquantized
    model against a copy whose layer-0 linears hold `results`' dequantized weights (layer 0's inputs
    are the embeddings in both, so no other layer enters)."""
    fp, quantized = tiny_model("llama"), tiny_model("llama")
    for name, qw in results.items():
        if name.startswith("model.layers.0."):
            quantized.get_submodule(name).weight.data = qw.dequantize()
    with torch.no_grad():
        want = fp(rows, output_hidden_states=True).hidden_states[1]
        got = quantized(rows, output_hidden_states=True).hidden_states[1]
    return float((got - want).pow(2).mean())


def test_it_lowers_the_layer_output_error_on_held_out_rows_against_its_gptq_start():
    """Layer 0's output error (transformers' forward of the dequantized weights) on sequences outside
    the calibration set is lower after signround than with GPTQ's weights alone; what the step logged
    for its held-out calibration sequences (never stepped on) agrees with the same recomputation."""
    options = dict(iters=40, eval_every=4, step_rule="scaled", start_position="centre", scale_range=[1, 1])
    recipe, tuned, _, ids = _quantize("gptq,signround", options, n=64, seq=64)
    _, gptq, _, _ = _quantize("gptq", {}, n=64, seq=64)
    fresh = torch.randint(2, 256, (32, 64), generator=torch.Generator().manual_seed(7))
    before, after = _layer0_error(gptq, fresh), _layer0_error(tuned, fresh)
    assert after < 0.985 * before, (before, after)  # measured: 0.00804 -> 0.00780 (-3.0 %)
    log = recipe.refiners[0].log[0]
    assert log["layer"] == 0 and log["best_step"] > 0
    assert log["held_out_start"] == pytest.approx(_layer0_error(gptq, ids[HELD_OUT]), rel=1e-4)
    assert log["held_out_best"] == pytest.approx(_layer0_error(tuned, ids[HELD_OUT]), rel=1e-4)
    assert log["held_out_best"] < log["held_out_start"]


def test_auto_rounds_rule_from_round_to_nearest_with_bf16_steps_lowers_the_error_on_fresh_rows():
    """auto-round's own rule (full-range grid, no range search, shrink-only group scales, signed steps
    of 1/iters from round-to-nearest) with the steps' forward/backward in bf16 (auto-round's CPU
    default): layer 0's error on sequences outside the calibration set falls below round-to-nearest's,
    and the held-out loss that picks the state kept is still the full-precision one (it equals
    transformers' fp32 forward of the kept weights)."""
    rule = dict(sym_range="full", mse=False, scale_range=[0.5, 1.0], iters=40, eval_every=4)
    recipe, tuned, _, ids = _quantize("rtn,signround", {**rule, "step_dtype": "bfloat16"}, n=64, seq=64)
    _, rtn, _, _ = _quantize("rtn", {"sym_range": "full", "mse": False}, n=64, seq=64)
    fresh = torch.randint(2, 256, (32, 64), generator=torch.Generator().manual_seed(7))
    before, after = _layer0_error(rtn, fresh), _layer0_error(tuned, fresh)
    assert after < 0.9 * before, (before, after)
    log = recipe.refiners[0].log[0]
    assert log["held_out_start"] == pytest.approx(_layer0_error(rtn, ids[HELD_OUT]), rel=1e-4)
    assert log["held_out_best"] == pytest.approx(_layer0_error(tuned, ids[HELD_OUT]), rel=1e-4)


def _same_bytes(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("qweight", "scales", "zeros", "g_idx"))


def test_start_rtn_tunes_from_round_to_nearest_and_keeps_the_quantizers_solution_where_it_is_better():
    """start=rtn: the steps start from plain round-to-nearest on the quantizer's grid (layer 0's
    held-out start equals `rtn,signround`'s), and the quantizer's own solution competes for the state
    kept on the same held-out sequences (its logged loss is transformers' forward of GPTQ's layer 0 alone).
    Both outcomes are checked against runs without the option: on the tiny Llama GPTQ's layer 0 wins
    (its bytes are kept exactly), and behind MSE round-to-nearest the tuned states win (the bytes of
    `rtn,signround` from the same start, every layer)."""
    rule = dict(scale_range=[0.5, 1.0], iters=20, eval_every=4)
    grid = dict(sym_range="full", mse=False)
    plain_recipe, plain, _, ids = _quantize("rtn,signround", {**rule, **grid}, n=64, seq=64)
    gptq_opts = dict(sym_range="full", desc_act=False)
    recipe, kept, _, _ = _quantize("gptq,signround", {**rule, **gptq_opts, "start": "rtn"}, n=64, seq=64)
    _, gptq, _, _ = _quantize("gptq", gptq_opts, n=64, seq=64)
    log, plain_log = recipe.refiners[0].log[0], plain_recipe.refiners[0].log[0]
    assert log["held_out_start"] == plain_log["held_out_start"]
    assert log["held_out_quantizer"] == pytest.approx(_layer0_error(gptq, ids[HELD_OUT]), rel=1e-4)
    assert log["kept"] == "quantizer" and log["held_out_quantizer"] < plain_log["held_out_best"]
    layer0 = [n for n in gptq if n.startswith("model.layers.0.")]
    assert all(_same_bytes(kept[n], gptq[n]) for n in layer0)
    assert log["held_out_best"] == pytest.approx(_layer0_error(kept, ids[HELD_OUT]), rel=1e-4)

    recipe, tuned, _, _ = _quantize("rtn,signround", {**rule, "sym_range": "full", "start": "rtn"}, n=64, seq=64)
    assert [r["kept"] for r in recipe.refiners[0].log] == ["tuned", "tuned"]
    assert all(r["held_out_quantizer"] > r["held_out_best"] for r in recipe.refiners[0].log)
    assert plain.keys() == tuned.keys() and all(_same_bytes(tuned[n], plain[n]) for n in plain)


def test_gguf_output_with_a_refiner_is_refused_at_plan_time_naming_the_recipe_that_can():
    """best-w4 (signround) cannot write GGUF's block grids: refused before any calibration, in one line that
    names gptaq-w4, which can."""
    from quantkit.plan import resolve_plan

    with pytest.raises(QuantkitError, match="gptaq-w4") as e:
        resolve_plan(recipe_file="best-w4", format="gguf")
    assert "\n" not in str(e.value)
    with pytest.raises(QuantkitError, match="signround tunes integer grids"):
        resolve_plan(method="gptq,signround", format="gguf")
    assert resolve_plan(recipe_file="gptaq-w4", format="gguf").recipe.quantizer.options["gptaq"] is True


def test_options_are_checked_with_one_line():
    with pytest.raises(QuantkitError, match="multiple of 8"):
        SignRoundRefiner(samples_per_step=6)
    with pytest.raises(QuantkitError, match="scale_range"):
        SignRoundRefiner(scale_range=[1.1, 1.2])
    with pytest.raises(QuantkitError, match="step_dtype must be one of float32, bfloat16"):
        SignRoundRefiner(step_dtype="fp16")
    with pytest.raises(QuantkitError, match="start must be quantizer or rtn"):
        SignRoundRefiner(start="gptq")
    with pytest.raises(QuantkitError, match="start_position='rounded' needs start=quantizer"):
        SignRoundRefiner(start="rtn", start_position="rounded")
    with pytest.raises(QuantkitError, match="weight quantizer"):
        build_recipe("signround", {})
    with pytest.raises(QuantkitError, match="num-samples 16"):
        _quantize("gptq,signround", {"iters": 2}, n=12)


@pytest.mark.slow  # two gloo ranks and four runs each: about 2 minutes each on a busy 2-core machine
@pytest.mark.parametrize("start", [{"start_position": "rounded"}, {"start": "rtn"}])
def test_two_ranks_and_a_resume_write_the_single_process_bytes(tiny_llama_dir, tmp_path, monkeypatch, start):
    """Gradients summed over the fixed shard tree, held-out losses in shard order: `--nproc 2` and a run
    interrupted after layer 0 and resumed on two ranks write the bytes of one uninterrupted process
    (from the "rounded" start: GPTQ's rounded weights are gathered from the ranks' row shares too; from the
    round-to-nearest start, best-w4's, with GPTAQ's solution competing on the ranks' held-out rows)."""
    import quantkit

    kwargs = dict(group_size=32, num_samples=19, seq_len=24, dataset="lee", progress=False,
                  options={"gptaq": True, "iters": 6, "eval_every": 2, **start})
    one = quantkit.quantize(str(tiny_llama_dir), "gptq,signround", output=tmp_path / "one", **kwargs)
    two = quantkit.quantize(str(tiny_llama_dir), "gptq,signround", output=tmp_path / "two", nproc=2, **kwargs)
    assert two["ranks"] == 2 and "ranks" not in one
    assert tree_sha256(tmp_path / "two") == tree_sha256(tmp_path / "one")
    interrupt_after_first_layer(monkeypatch, lambda: quantkit.quantize(
        str(tiny_llama_dir), "gptq,signround", output=tmp_path / "resumed", **kwargs))
    quantkit.quantize(str(tiny_llama_dir), "gptq,signround", output=tmp_path / "resumed", resume=True, nproc=2,
                      **kwargs)
    assert tree_sha256(tmp_path / "resumed") == tree_sha256(tmp_path / "one")


def test_the_run_reports_per_layer_what_signround_kept_in_its_summary_and_card_and_after_a_resume(
        tiny_llama_dir, tmp_path, monkeypatch):
    """quantize's summary and model card say per run which state signround kept (tuned, the quantizer's, the
    start) in how many layers; the per-layer reports live with the layers in the progress store, so a run
    interrupted after layer 0 and resumed reports exactly what the uninterrupted one does."""
    import quantkit

    kwargs = dict(group_size=32, num_samples=16, seq_len=24, dataset="lee", progress=False,
                  options={"gptaq": True, "iters": 4, "eval_every": 2, "start": "rtn"})
    one = quantkit.quantize(str(tiny_llama_dir), "gptq,signround", output=tmp_path / "one", **kwargs)
    report = one["refinement"]["signround"]
    assert report["layers"] == 2 and sum(report["kept"].values()) == 2
    assert report["mean_held_out_change"] <= 0  # the start is a candidate: never worse on those rows
    card = (tmp_path / "one" / "README.md").read_text()
    assert "## Refinement" in card and "- signround (2 layers): kept the tuned state in" in card
    interrupt_after_first_layer(monkeypatch, lambda: quantkit.quantize(
        str(tiny_llama_dir), "gptq,signround", output=tmp_path / "resumed", **kwargs))
    resumed = quantkit.quantize(str(tiny_llama_dir), "gptq,signround", output=tmp_path / "resumed", resume=True,
                                **kwargs)
    assert resumed["refinement"] == one["refinement"]
    assert tree_sha256(tmp_path / "resumed") == tree_sha256(tmp_path / "one")
