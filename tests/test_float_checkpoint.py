"""A tiny model written with a float preset (#47) and read back by transformers + compressed-tensors (the
oracle): the weights compressed-tensors decompresses are exactly the ones quantkit dequantized."""
import json

import pytest
import torch
import transformers

from quantkit.errors import QuantkitError
from quantkit.float_checkpoint import WRITABLE, write
from quantkit.scheme_presets import preset

pytest.importorskip("compressed_tensors")


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("name", WRITABLE)
def test_compressed_tensors_decompresses_quantkits_weights(tmp_path, name):
    model = _tiny_llama()
    out = tmp_path / name
    ours = write(model, preset(name), out)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["ignore"] == ["lm_head"] and len(ours) == 7
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    for module_name, w in ours.items():
        got = loaded.get_submodule(module_name).weight.detach()
        # compressed-tensors decompresses FP4 layouts in bfloat16; quantkit's values are exact there
        want = w.to(torch.bfloat16).to(got.dtype) if "FP4" in name else w.to(got.dtype)
        assert torch.equal(got, want), module_name
        original = model.get_submodule(module_name).weight.detach()
        assert not torch.equal(got, original)  # really quantized
        rel = (got.float() - original).norm() / original.norm()
        assert rel < (0.2 if "FP4" in name else 0.05), (module_name, float(rel))


def test_presets_that_need_calibration_are_refused(tmp_path):
    for name in ("FP8", "NVFP4", "W4A16"):
        with pytest.raises(QuantkitError, match=f"--scheme {name} cannot be written by round-to-nearest yet"):
            write(_tiny_llama(), preset(name), tmp_path / name)
        assert not (tmp_path / name).exists()
    (tmp_path / "taken").mkdir()
    with pytest.raises(QuantkitError, match="already exists"):
        write(_tiny_llama(), preset("NVFP4A16"), tmp_path / "taken")
