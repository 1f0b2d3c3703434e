"""The spine end to end on the real demo model: RTN w4 -> checkpoint -> load (reference, cpu) -> perplexity."""
import json

import pytest
import torch

from conftest import last_json, run_cli

pytestmark = pytest.mark.slow
MAX_WINDOWS = 8


@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "smollm2-rtn-w4g64"
    proc = run_cli("quantize", "--method", "rtn", "--bits", "4", "--output", out, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    assert summary["output"] == str(out) and summary["bits"] == 4 and summary["group_size"] == 64
    assert summary["format"] == "gptq" and summary["method"] == "rtn"
    assert summary["peak_rss_mb"] > 0 and summary["seconds"] > 0
    return out


def test_checkpoint_is_hub_ready(rtn_checkpoint):
    files = {p.name for p in rtn_checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    cfg = json.loads((rtn_checkpoint / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "gptq" and q["bits"] == 4 and q["group_size"] == 64 and q["checkpoint_format"] == "gptq"
    assert q["sym"] is True and q["desc_act"] is False
    card = (rtn_checkpoint / "README.md").read_text()
    assert card.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n")
    assert "library_name: transformers" in card and "- 4-bit" in card
    # every decoder linear is packed, lm_head is tied to the embeddings and not stored
    from safetensors import safe_open

    with safe_open(str(rtn_checkpoint / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.down_proj.qweight").get_shape() == [1536 // 8, 576]
        assert f.get_slice("model.layers.0.mlp.down_proj.scales").get_shape() == [1536 // 64, 576]
    assert sum(k.endswith(".qweight") for k in keys) == 30 * 7
    assert not any(k.endswith("proj.weight") for k in keys) and "lm_head.weight" not in keys


def test_perplexity_reference_cpu_and_original(rtn_checkpoint):
    proc_ref = run_cli("eval", "--model", rtn_checkpoint, "--baseline", "demo", "--backend", "reference",
                       "--max-windows", MAX_WINDOWS, "--json")
    assert proc_ref.returncode == 0, proc_ref.stderr[-3000:]
    ref = last_json(proc_ref.stdout)
    proc_cpu = run_cli("eval", "--model", rtn_checkpoint, "--backend", "cpu", "--max-windows", MAX_WINDOWS, "--json")
    assert proc_cpu.returncode == 0, proc_cpu.stderr[-3000:]
    cpu = last_json(proc_cpu.stdout)
    assert ref["windows"] == MAX_WINDOWS and ref["tokens"] == MAX_WINDOWS * 511
    # quantized is worse than the original, by a sane amount (RTN w4g64 on a 135M model)
    assert ref["perplexity"] > ref["baseline_perplexity"]
    assert ref["perplexity"] < 1.6 * ref["baseline_perplexity"]
    # the two backends agree within 0.5%
    assert abs(cpu["perplexity"] - ref["perplexity"]) / ref["perplexity"] < 0.005
    print("rtn w4g64:", ref, cpu)


def test_inspect(rtn_checkpoint):
    proc = run_cli("inspect", "--model", rtn_checkpoint, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = last_json(proc.stdout)
    assert r["quant_method"] == "gptq" and r["quantized_linears"] == 210
    assert all(v["bits"] == 4 and v["group_size"] == 64 for v in r["layers"].values())
    assert r["compression"] > 1.5
