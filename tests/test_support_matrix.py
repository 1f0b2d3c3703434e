"""The model card states the loaders checked for the layout it describes, from the support matrix
(quantkit.formats.loaders); tests/test_vllm.py checks the matrix's vLLM rows against vLLM itself."""
from quantkit.checkpoint import model_card
from quantkit.formats import loaders
from quantkit.formats.spec import LinearSpec


def _specs(**kw):
    return {"model.layers.0.mlp.down_proj": LinearSpec(576, 1536, **{"bits": 4, "group_size": 64, **kw})}


def _card(fmt, **kw):
    return model_card("HuggingFaceTB/SmolLM2-135M-Instruct", fmt, {"method": "gptq"}, {"quant_method": fmt}, _specs(**kw))


def test_default_gptq_card_says_vllm_loads_it():
    card = _card("gptq", sym=True, act_order="static")
    assert f"- {loaders.VLLM}: loads the folder unmodified" in card
    assert "GPTQModel" in card


def test_refused_layouts_say_why():
    assert "refuses it" in _card("gptq", sym=False) and "asymmetric" in _card("gptq", sym=False)
    assert "no longer supported" in _card("gptq", act_order="dynamic")
    assert loaders.vllm_refusal("gptq", _specs(act_order="dynamic", group_size=-1).values()) is None


def test_asymmetric_compressed_tensors_card_does_not_claim_transformers():
    card = _card("compressed-tensors", sym=False)
    assert "does not load asymmetric" in card
    assert "transformers 5.25 + compressed-tensors 0.20: loads" in _card("compressed-tensors", sym=True)


def test_gguf_card_names_llama_cpp_only():
    lines = loaders.loaders_checked("gguf", _specs().values())
    assert len(lines) == 1 and lines[0].startswith("llama.cpp")


def test_writing_a_layout_vllm_refuses_says_so(tmp_path, tiny_llama_dir):
    import warnings

    import quantkit
    from quantkit.notices import reset_notices

    reset_notices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, sym=False, format="gptq",
                          output=tmp_path / "asym", progress=False, options={"mse": False})
    said = [str(w.message) for w in caught if "will not load this checkpoint" in str(w.message)]
    assert len(said) == 1 and "asymmetric" in said[0]
    assert "refuses it" in (tmp_path / "asym" / "README.md").read_text()


def test_float_cards_say_served_refused_or_not_checked():
    from quantkit.float_card import float_model_card
    from quantkit.scheme_presets import preset

    shapes = {"model.layers.0.mlp.down_proj": (512, 1536)}

    def vllm_line(name):
        card = float_model_card("demo", preset(name), {"method": "rtn"}, {"format": "x"}, shapes)
        return next(line for line in card.splitlines() if line.startswith(f"- {loaders.VLLM}"))

    assert "loads the folder unmodified" in vllm_line("FP8_DYNAMIC")
    assert "refuses it" in vllm_line("NVFP4A16") and "Marlin FP4" in vllm_line("NVFP4A16")
    assert "refuses it" in vllm_line("MXFP8") and "MXFP8 linear layer" in vllm_line("MXFP8")
    # never tried in vLLM (the demo's inputs do not divide into its activation groups): no claim either way
    assert vllm_line("MXFP4XFP8") == f"- {loaders.VLLM}: not checked for this preset (neither its CPU build nor its GPU kernels)"
    card = float_model_card("demo", preset("MXFP8"), {"method": "rtn"}, {"format": "x"}, shapes)
    assert "- weights: FP8 (E4M3), groups of 32, E8M0 (power-of-two) scales" in card
