"""The checkpoint's model card carries Hub metadata that huggingface_hub's own parser reads.

The oracle is `huggingface_hub.ModelCard` (what the Hub and `push_to_hub` use): the card must parse,
`base_model` must appear only for a hub source (a local folder has no hub page), `license` and
`language` come from the source where it states them, `datasets` names the calibration data, and
`model-index` holds exactly the figures `quantize --eval` measured, and only when it ran.
"""
import shutil

import pytest
from huggingface_hub import ModelCard

import quantkit
from quantkit.card_metadata import front_matter, render_front_matter


@pytest.fixture(scope="module")
def licensed_source(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a README stating a license and languages, as a Hub model folder has."""
    folder = tmp_path_factory.mktemp("licensed") / "tiny"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "README.md").write_text("---\nlicense: mit\nlanguage:\n- en\n- fr\ndatasets:\n- some/pretraining-set\n"
                                      "---\n\n# tiny\n")
    return folder


def test_local_source_card_parses_without_base_model_or_model_index(tiny_llama_dir, tmp_path):
    out = tmp_path / "rtn"
    quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, output=out, progress=False)
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert "base_model" not in data and "base_model_relation" not in data
    assert "license" not in data and "language" not in data  # the folder states neither
    assert "datasets" not in data  # RTN reads no calibration data
    assert "model-index" not in data and card.data.eval_results is None
    assert data["tags"] == ["quantkit", "rtn", "gptq", "4-bit"]
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert "huggingface.co" not in card.text  # no link to a hub page that does not exist
    assert f"`{tiny_llama_dir}`" in card.text


def test_eval_run_carries_license_language_and_model_index(licensed_source, tmp_path):
    out = tmp_path / "rtn"
    summary = quantkit.quantize(str(licensed_source), "rtn", bits=4, group_size=32, output=out, eval_after=True,
                                progress=False)
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert "base_model" not in data
    assert data["license"] == "mit" and data["language"] == ["en", "fr"]
    assert "datasets" not in data  # the calibration data's (none for RTN), never the source's pretraining sets
    results = card.data.eval_results
    assert [r.metric_type for r in results] == ["perplexity", "kl_divergence", "kl_divergence_p99", "top1_agreement"]
    assert {r.dataset_name for r in results} == {"lee (held-out split)"}
    assert {r.task_type for r in results} == {"text-generation"}
    by_type = {r.metric_type: r.metric_value for r in results}
    m = summary["metrics"]
    assert by_type["perplexity"] == pytest.approx(m["held-out perplexity"], abs=1e-4)
    assert by_type["kl_divergence"] == pytest.approx(m["kl_mean"], abs=1e-5)
    assert by_type["kl_divergence_p99"] == pytest.approx(m["kl_p99"], abs=1e-5)
    assert by_type["top1_agreement"] == pytest.approx(m["top1_agreement"], abs=1e-5)
    assert "## Measured" in card.text  # the human-readable section stays


def test_hub_source_gets_base_model_and_the_cached_license(tmp_path, monkeypatch):
    """A hub id is the one source with a hub page; its license comes from its README in the local
    Hugging Face cache (no network), laid out as huggingface_hub lays it out."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nlicense: other\nlicense_name: org-license\nlicense_link: LICENSE\n"
                                        "language: en\n---\n")
    (tmp_path / "hub" / "models--org--model" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--model" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    data = ModelCard(render_front_matter(front_matter("org/model", ["quantkit", "gptq"], "wikitext2"))).data.to_dict()
    assert data["base_model"] == "org/model" and data["base_model_relation"] == "quantized"
    assert (data["license"], data["license_name"], data["license_link"]) == ("other", "org-license", "LICENSE")
    assert data["language"] == ["en"]
    assert data["datasets"] == ["wikitext"]  # the registry's hub id for wikitext2
    uncached = ModelCard(render_front_matter(front_matter("org/other", ["quantkit"], None))).data.to_dict()
    assert uncached["base_model"] == "org/other" and "license" not in uncached and "datasets" not in uncached


def test_a_local_folder_named_like_a_hub_id_is_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    data = ModelCard(render_front_matter(front_matter("org/model", ["quantkit"], "my-data.txt"))).data.to_dict()
    assert "base_model" not in data and "datasets" not in data


@pytest.mark.parametrize("name", ["tiny", "llama", "in-memory llama (weights sha256 ab12)", "./gone/model.gguf"])
def test_names_that_are_not_hub_ids_get_no_base_model(tmp_path, monkeypatch, name):
    """A bare name (an in-memory model's model_type, a folder that is gone) or a description has no hub page."""
    monkeypatch.chdir(tmp_path)
    data = ModelCard(render_front_matter(front_matter(name, ["quantkit"], None))).data.to_dict()
    assert "base_model" not in data


@pytest.mark.parametrize("dataset,listed", [("lee", ["gensim lee_background corpus"]),
                                            ("wiki", ["gensim enwiki-latest-pages-articles1 sample"]),
                                            ("c4", ["allenai/c4"]), ("corpus.txt", None), (None, None)])
def test_datasets_names_the_calibration_data(tmp_path, monkeypatch, dataset, listed):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    data = ModelCard(render_front_matter(front_matter("src", ["quantkit"], dataset))).data.to_dict()
    assert data.get("datasets") == listed


def test_convert_keeps_the_base_model_its_source_card_names(tiny_llama_dir, tmp_path):
    """A re-pack changes no weight, so it is still a quantization of the model the source card names."""
    src = tmp_path / "gptq"
    quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, output=src, progress=False)
    card = (src / "README.md").read_text()
    assert card.startswith("---\n")
    (src / "README.md").write_text("---\nbase_model: org/model\nbase_model_relation: quantized\n" + card[4:])
    from quantkit.convert import convert

    convert(src, "compressed-tensors", tmp_path / "ct")
    converted = ModelCard.load(tmp_path / "ct" / "README.md")
    data = converted.data.to_dict()
    assert data["base_model"] == "org/model" and data["base_model_relation"] == "quantized"
    assert "Re-packed by `quantkit convert`" in converted.text and "https://huggingface.co/org/model" in converted.text


def test_convert_of_a_local_source_checkpoint_names_no_base_model(tiny_llama_dir, tmp_path):
    src = tmp_path / "gptq"
    quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, output=src, progress=False)
    from quantkit.convert import convert

    convert(src, "compressed-tensors", tmp_path / "ct")
    data = ModelCard.load(tmp_path / "ct" / "README.md").data.to_dict()
    assert "base_model" not in data and data["library_name"] == "transformers"


def test_gguf_output_card_names_the_gguf_library(tiny_llama_dir, tmp_path):
    out = tmp_path / "gguf"
    quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, format="gguf", output=out, progress=False)
    data = ModelCard.load(out / "README.md").data.to_dict()
    assert data["library_name"] == "gguf" and "gguf" in data["tags"]


def test_float_preset_run_writes_a_card_that_names_its_grids_and_carries_eval(licensed_source, tmp_path):
    """A --scheme run (compressed-tensors float layouts) gets a card like the integer writer's: Hub metadata
    huggingface_hub parses, the preset's grids in words, what vLLM does with it, and with --eval the measured
    figures, equal to scoring the folder afterwards."""
    out = tmp_path / "nvfp4"
    result = quantkit.quantize(str(licensed_source), "rtn", scheme="NVFP4A16", output=out, eval_after=True,
                               progress=False)
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["tags"] == ["quantkit", "rtn", "compressed-tensors", "nvfp4a16"] and data["license"] == "mit"
    assert "- scheme: `NVFP4A16` (format `nvfp4-pack-quantized`, quant_method `compressed-tensors`)" in card.text
    assert "- weights: FP4 (E2M1), groups of 16 under a global scale, float8_e4m3fn scales" in card.text
    assert "- input activations: not quantized (16-bit)" in card.text and "Marlin FP4" in card.text
    assert f"- quantized linears: {result.summary['quantized_linears']};" in card.text
    direct = quantkit.evaluate(out, baseline=str(licensed_source), dataset="lee")
    by_type = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert by_type["kl_divergence"] == pytest.approx(direct["kl_mean"], abs=1e-5) and direct["kl_mean"] > 0
    assert result.metrics["kl_mean"] == pytest.approx(direct["kl_mean"], rel=1e-6)
