"""External oracles: transformers + compressed-tensors load our checkpoints and agree with quantkit.load.

The tiny random Llama keeps this fast; the oracle is transformers' own forward over weights that
the compressed-tensors library decompressed, so nothing of quantkit's unpacking is involved there.
"""
import pytest
import torch

import quantkit
from quantkit.runtime import QuantLinear

pytest.importorskip("compressed_tensors")


def hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits, model


def quantkit_logits(path, ids, backend="reference"):
    model = quantkit.load(path, backend=backend, dtype="float32")
    with torch.no_grad():
        return model(ids).logits, model


def dequantized(model) -> dict:
    return {n: m.quantized_weight().dequantize() for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def test_compressed_tensors_checkpoint_loads_in_transformers_and_matches(tmp_path, tiny_llama_dir):
    ct = tmp_path / "ct"
    gq = tmp_path / "gptq"
    quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, format="compressed-tensors", output=ct, progress=False)
    quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, format="gptq", output=gq, progress=False)
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    ref_logits, hf_model = hf_logits(ct, ids)
    qk_logits, qk_model = quantkit_logits(ct, ids)
    torch.testing.assert_close(qk_logits, ref_logits, rtol=1e-4, atol=1e-4)
    # the weights compressed-tensors decompressed are exactly ours, and the gptq layout holds the same
    ours = dequantized(qk_model)
    assert len(ours) == 14
    for name, w in ours.items():
        torch.testing.assert_close(hf_model.get_submodule(name).weight.float(), w, rtol=0, atol=0)
    _, gq_model = quantkit_logits(gq, ids)
    for name, w in dequantized(gq_model).items():
        assert torch.equal(w, ours[name]), name


def test_gptq_static_act_order_through_compressed_tensors(tmp_path, tiny_llama_dir):
    ct = tmp_path / "ct-gptq"
    quantkit.quantize(str(tiny_llama_dir), "gptq", bits=4, group_size=32, format="compressed-tensors", output=ct,
                      options={"desc_act": True, "static_groups": True}, num_samples=8, seq_len=64, progress=False)
    import json

    group = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["actorder"] in ("weight", "static")
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(1))
    ref_logits, _ = hf_logits(ct, ids)
    qk_logits, _ = quantkit_logits(ct, ids)
    torch.testing.assert_close(qk_logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_dynamic_act_order_gptq_checkpoint_dequantizes_to_gptq_result(tmp_path, tiny_llama_dir):
    """Dynamic act-order: the saved g_idx makes the loader reproduce exactly the weights GPTQ produced."""
    from quantkit import api, data
    from quantkit.pipeline import quantize_model
    from quantkit.checkpoint import staging_dir, write_checkpoint
    from quantkit.progress import ProgressStore
    from quantkit.models import get_adapter
    from quantkit.quantizers import get_quantizer
    from quantkit.scheme import QuantScheme
    from quantkit.sources import load_source_model

    model, tok, _, _ = load_source_model(str(tiny_llama_dir))
    schemes = QuantScheme(bits=4, group_size=32, sym=False).resolve(api.linear_shapes(model))
    ids = data.calibration_batches("lee", tok, num_samples=8, seq_len=64)
    quantizer = get_quantizer("gptq", desc_act=True, static_groups=False)
    store = ProgressStore(staging_dir(tmp_path / "dyn"))
    store.start({"test": 1}, resume=False)
    quantize_model(model, get_adapter(model), quantizer, schemes, ids, progress=False, store=store)
    results = {k: v for i in store.done_layers() for k, v in store.load_layer(i).quantized.items()}
    assert set(results) == set(schemes)
    assert all(r.act_order == "dynamic" for r in results.values())
    assert not all(r.has_trivial_g_idx() for r in results.values())
    out = write_checkpoint(tmp_path / "dyn", model, tok, store, "model.layers", "gptq", quantizer.describe(),
                           quantizer.format_extra(), "tiny", torch.float32, ["lm_head"])
    loaded = quantkit.load(out, backend="reference", dtype="float32")
    for name, w in dequantized(loaded).items():
        assert torch.equal(w, results[name].dequantize()), name
        # and the model the driver left behind (fake-quantized) computed with exactly these weights
        assert torch.equal(model.get_submodule(name).weight.data.float(), w)
    # the cpu backend handles the non-trivial g_idx by permuting activation columns once
    cpu = quantkit.load(out, backend="cpu", dtype="float32")
    x = torch.randint(0, 49152, (1, 16))
    with torch.no_grad():
        a, b = loaded(x).logits, cpu(x).logits
    assert ((a - b).norm() / a.norm()).item() < 2e-2
    import json

    assert json.loads((out / "config.json").read_text())["quantization_config"]["desc_act"] is True
    # compressed-tensors cannot express groups formed in processing order: a clear error, no output
    from quantkit.formats import get_format

    with pytest.raises(quantkit.QuantkitError, match="act-order|actorder|g_idx"):
        get_format("compressed-tensors").pack(next(iter(results.values())))
