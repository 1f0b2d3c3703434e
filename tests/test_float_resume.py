"""An interrupted float-preset run (#47) resumes from its last finished layer and writes the bytes an
uninterrupted run writes: GPTQ's float results (with the input absmax its static scales come from), a
transform pass's layers (SmoothQuant before GPTQ) and W4AFP8's integer results all come back from the
progress store exactly."""

import pytest
import torch

import quantkit
from test_robustness import tree_sha256 as _tree
from quantkit.errors import QuantkitError

pytest.importorskip("compressed_tensors")

CALIBRATION = dict(num_samples=4, seq_len=32, seed=1, progress=False)


def _interrupted(monkeypatch, run, after: int) -> None:
    """`run()` stopped by KeyboardInterrupt (as a Ctrl-C) right after the `after`-th layer record of the run
    is saved (a transform pass's layers count first); the driver as it was afterwards."""
    from quantkit.pipeline import driver

    persist = driver.LayerByLayer.persist
    saved = []

    def persist_then_stop(self, i, results, stored):
        persist(self, i, results, stored)
        if i not in self.done:
            saved.append(i)
            if len(saved) == after:
                raise KeyboardInterrupt

    monkeypatch.setattr(driver.LayerByLayer, "persist", persist_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(driver.LayerByLayer, "persist", persist)


@pytest.mark.parametrize("scheme,method,after", [
    ("NVFP4", "gptq", 1),  # FloatResults with the input absmax of NVFP4's static input global scales
    ("FP8", "gptq", 1),  # per-tensor FP8 weights (the weight type's non-tensor fields) and static input scales
    ("MXFP4A16", "gptq", 1),
    ("NVFP4", "smoothquant,gptq", 1),  # stopped inside the SmoothQuant pass
    ("NVFP4", "smoothquant,gptq", 3),  # the pass finished, GPTQ's first layer saved
    ("W4AFP8", "gptq", 1),  # the integer weights' records
    ("NVFP4", "gptq,signround", 1),  # SignRound's refined float results, with the absmax GPTQ observed
])
def test_an_interrupted_float_run_resumes_to_the_same_bytes(tmp_path, monkeypatch, tiny_llama_128_dir, scheme, method,
                                                           after):
    src = str(tiny_llama_128_dir)
    if "signround" in method:  # SignRound holds out a sequence of each of its 8 shards: 16 at least
        monkeypatch.setitem(CALIBRATION, "num_samples", 16)
        monkeypatch.setitem(CALIBRATION, "options", {"iters": 4, "eval_every": 2})
    quantkit.quantize(src, method, scheme=scheme, output=tmp_path / "whole", **CALIBRATION)
    whole = _tree(tmp_path / "whole")

    out, staging = tmp_path / "out", tmp_path / ".out.partial"
    _interrupted(monkeypatch, lambda: quantkit.quantize(src, method, scheme=scheme, output=out, **CALIBRATION), after)
    records = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("layer-*.safetensors"))
    assert len(records) == after, records
    assert not out.exists()

    # without --resume: refused in one line naming the fix, the records untouched
    before = _tree(staging)
    with pytest.raises(QuantkitError, match="--resume"):
        quantkit.quantize(src, method, scheme=scheme, output=out, **CALIBRATION)
    assert _tree(staging) == before

    quantkit.quantize(src, method, scheme=scheme, output=out, resume=True, **CALIBRATION)
    assert _tree(out) == whole
    assert not staging.exists()


def test_a_float_resume_with_other_settings_is_refused(tmp_path, monkeypatch, tiny_llama_128_dir):
    """The records belong to one run: another calibration seed or another preset is refused, nothing changed."""
    src, out, staging = str(tiny_llama_128_dir), tmp_path / "out", tmp_path / ".out.partial"
    _interrupted(monkeypatch, lambda: quantkit.quantize(src, "gptq", scheme="NVFP4A16", output=out, **CALIBRATION), 1)
    before = _tree(staging)
    with pytest.raises(QuantkitError, match="different settings.*calibration_digest"):
        quantkit.quantize(src, "gptq", scheme="NVFP4A16", output=out, resume=True, **{**CALIBRATION, "seed": 2})
    with pytest.raises(QuantkitError, match="different settings"):
        quantkit.quantize(src, "gptq", scheme="MXFP4A16", output=out, resume=True, **CALIBRATION)
    assert _tree(staging) == before


def test_a_float_run_that_fails_before_any_layer_leaves_nothing(tmp_path, tiny_llama_128_dir):
    """A refusal inside the writer (here GPTQ's option check) leaves no staging folder to resume."""
    out = tmp_path / "out"
    with pytest.raises(QuantkitError, match="damp_percent"):
        quantkit.quantize(str(tiny_llama_128_dir), "gptq", scheme="NVFP4A16", output=out,
                          options={"damp_percent": 2.0}, **CALIBRATION)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_float_record_round_trips_every_weight_type_exactly():
    """FloatResult's record form (quantkit.progress keeps it) rebuilds each float weight type bit for bit."""
    from quantkit.float_codecs import fp8, mxfp4, mxfp8, nvfp4
    from quantkit.float_codecs.result import FloatResult

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    weights = [fp8.quantize(w, "tensor"), fp8.quantize(w, "channel"), fp8.quantize(w, "block", (16, 32)),
               mxfp8.quantize(w), nvfp4.quantize(w), mxfp4.quantize(w)]
    for q in weights:
        result = FloatResult(q, torch.randn(32), {"loss": 0.5}, torch.tensor(3.25))
        tensors, meta = result.record()
        back = FloatResult.from_record({k: v.clone() for k, v in tensors.items()}, meta)
        assert type(back.weight) is type(q)
        assert torch.equal(back.dequantize(), result.dequantize())
        for field in q.__dataclass_fields__:
            a, b = getattr(q, field), getattr(back.weight, field)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field
        assert torch.equal(back.bias, result.bias) and torch.equal(back.input_absmax, result.input_absmax)
        assert back.stats == {"loss": 0.5}
