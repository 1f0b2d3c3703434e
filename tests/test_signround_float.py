"""SignRound on the FP4 grids (NVFP4, MXFP4; `--method gptq,signround` with a float preset): the tuned state
starts exactly at GPTQ's solution, moves values along the E2M1 grid and NVFP4's group scales along E4M3, and
the refined checkpoint is what compressed-tensors decompresses. The oracles: the E2M1 / E4M3 definitions in
plain PyTorch (a table of the 15 values, torch's float8 cast) and compressed-tensors' decompression."""
import pytest
import torch
import transformers

from quantkit.errors import QuantkitError
from quantkit.float_codecs import e2m1, mxfp4, nvfp4
from quantkit.float_codecs.result import FloatResult
from quantkit.quantizers.signround_float import TunedFloatLinear, bin_edges

pytest.importorskip("compressed_tensors")

VALUES = torch.tensor([-6.0, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])


def _weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    moved = w + 0.3 * torch.randn(8, 64, generator=g) * w.abs().mean()  # "GPTQ's" weight: codes unlike RTN's of w
    return w, {"nvfp4": nvfp4.quantize(moved, gscale=nvfp4.global_scale(w.abs().amax())), "mxfp4": mxfp4.quantize(moved)}


def test_start_bins_are_the_midpoints_between_neighbouring_values_and_end_at_the_grid():
    lower, upper = bin_edges(VALUES)
    for i, v in enumerate(VALUES):
        assert float(lower[i]) == (float(VALUES[i - 1] + v) / 2 if i else -6.0)
        assert float(upper[i]) == (float(VALUES[i + 1] + v) / 2 if i + 1 < len(VALUES) else 6.0)
    inside = torch.stack([lower + 1e-3, upper - 1e-3])
    assert torch.equal(e2m1.nearest_value(inside), torch.stack([VALUES, VALUES]))


@pytest.mark.parametrize("grid", ["nvfp4", "mxfp4"])
def test_the_start_is_the_quantizers_solution_bit_for_bit(grid):
    w, quantized = _weights()
    start = quantized[grid]
    t = TunedFloatLinear.start_from("x", FloatResult(start, input_absmax=torch.tensor(2.0)), w, "cpu")
    ones, zeros = torch.ones_like(t.factor), torch.zeros_like(t.offset)
    assert torch.equal(t.dequantized(ones, zeros), start.dequantize())
    kept = t.result(ones, zeros)
    assert torch.equal(kept.dequantize(), start.dequantize())
    assert float(kept.input_absmax) == 2.0  # what the quantizer observed carries over
    nonzero = e2m1.decode(start.codes) != 0  # a zero's sign bit may differ; its value does not
    assert torch.equal(kept.weight.codes[nonzero], start.codes[nonzero])
    assert t.tunes_scales == (grid == "nvfp4")  # MX exponents are powers of two: a factor near 1 never moves them


@pytest.mark.parametrize("grid", ["nvfp4", "mxfp4"])
def test_an_offset_moves_a_value_to_its_neighbour_on_the_grid(grid):
    w, quantized = _weights()
    t = TunedFloatLinear.start_from("x", FloatResult(quantized[grid]), w, "cpu")
    ones = torch.ones_like(t.factor)
    q = e2m1.decode(quantized[grid].codes)
    i, j = (int(x) for x in torch.nonzero((q > 0) & (q < 6))[0])  # a positive value below the top
    offset = torch.zeros_like(t.offset)
    _, upper = bin_edges(q[i, j].reshape(1))
    offset[i, j] = float(upper) - float(t.start[i, j]) + 1e-3  # just past the upper edge
    step = t.steps(ones).repeat_interleave(t.group, dim=1)
    moved = t.dequantized(ones, offset) / step
    following = VALUES[VALUES > q[i, j]][0]
    assert float(moved[i, j]) == float(following)
    others = torch.ones_like(q, dtype=torch.bool)
    others[i, j] = False
    assert torch.equal(moved[others], q[others])
    # straight through: d(W_q)/dV is the element's step
    v = torch.zeros_like(t.offset, requires_grad=True)
    t.dequantized(ones, v).sum().backward()
    assert torch.equal(v.grad, step)


def test_an_nvfp4_scale_factor_is_rounded_to_e4m3_under_the_global_scale():
    w, quantized = _weights()
    start = quantized["nvfp4"]
    t = TunedFloatLinear.start_from("x", FloatResult(start), w, "cpu")
    factor = torch.full_like(t.factor, 1.1)
    kept = t.result(factor, torch.zeros_like(t.offset))
    want = (start.group_scale.to(torch.float32) * 1.1).to(torch.float8_e4m3fn)  # torch's own E4M3 rounding
    assert torch.equal(kept.weight.group_scale, want)
    assert torch.equal(kept.weight.global_scale, start.global_scale)
    assert torch.equal(kept.dequantize(), t.dequantized(factor, torch.zeros_like(t.offset)))


def test_8_bit_grids_and_starts_a_float_grid_cannot_give_are_refused(tmp_path, tiny_llama_dir):
    import quantkit

    src = str(tiny_llama_dir)
    with pytest.raises(QuantkitError, match="4-bit float grids"):
        quantkit.quantize(src, "gptq,signround", scheme="FP8_DYNAMIC", output=tmp_path / "a", num_samples=16,
                          seq_len=16, progress=False)
    with pytest.raises(QuantkitError, match="start=quantizer"):
        quantkit.quantize(src, "gptq,signround", scheme="NVFP4A16", output=tmp_path / "b", options={"start": "rtn"},
                          num_samples=16, seq_len=16, progress=False)
    with pytest.raises(QuantkitError, match="drop sym_range"):
        quantkit.quantize(src, "gptq,signround", scheme="NVFP4A16", output=tmp_path / "c",
                          options={"sym_range": "full"}, num_samples=16, seq_len=16, progress=False)
    assert not list(tmp_path.iterdir())


def test_the_card_names_the_options_a_float_grid_sets_for_signround(tmp_path, tiny_llama_dir):
    """The float defaults (scales kept, scaled steps) differ from the integer recipe's: the card says them."""
    import quantkit

    result = quantkit.quantize(str(tiny_llama_dir), "gptq,signround", scheme="NVFP4A16", output=tmp_path / "sr",
                               num_samples=16, seq_len=16, options={"iters": 2}, progress=False)
    card = (tmp_path / "sr" / "README.md").read_text()
    assert "- method: `gptq+signround`" in card
    assert "- scale_range: `[1.0, 1.0]`" in card and "- step_rule: `scaled`" in card and "- iters: `2`" in card
    # the refiner's per-layer choices, as on an integer card (the layer stats the pipeline kept)
    report = result.summary["refinement"]["signround"]
    assert report["layers"] == 2 and sum(report["kept"].values()) == 2 and report["mean_held_out_change"] <= 0
    assert "## Refinement" in card and "- signround (2 layers): kept the tuned state in" in card


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                                   tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_refined_layers_are_no_worse_than_gptqs_start_on_held_out_rows_and_compressed_tensors_reads_them(
        tmp_path, monkeypatch, name):
    """Each layer keeps a state no worse than GPTQ's on the held-out calibration rows, and (NVFP4A16, on this
    model and data) some layer a strictly better one, so the refined checkpoint differs from GPTQ's; it
    decompresses through compressed-tensors to exactly quantkit's weights."""
    from test_float_checkpoint import _decompressed_by_compressed_tensors

    from quantkit.float_checkpoint import read_dequantized, write
    from quantkit.quantizers import signround
    from quantkit.scheme_presets import preset

    log = []
    tune = signround._LayerRun.tune

    def logged(self, results):
        out = tune(self, results)
        log.append(self.step.log[-1])
        return out

    monkeypatch.setattr(signround._LayerRun, "tune", logged)
    ids = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(1))
    write(_tiny_llama(), preset(name), tmp_path / "gptq", method="gptq", calibration=ids)
    write(_tiny_llama(), preset(name), tmp_path / "sr", method="gptq+signround", calibration=ids,
          options={"iters": 40, "eval_every": 4})
    gptq, refined = read_dequantized(tmp_path / "gptq"), read_dequantized(tmp_path / "sr")
    assert [e["layer"] for e in log] == [0, 1]
    assert all(e["held_out_best"] <= e["held_out_start"] for e in log)
    if name == "NVFP4A16":
        assert any(e["kept"] == "tuned" and e["held_out_best"] < e["held_out_start"] for e in log), log
        assert any(not torch.equal(refined[n], gptq[n]) for n in gptq)
    _decompressed_by_compressed_tensors(tmp_path / "sr", refined, name)
