"""One run configuration (#46 item 2) and --scheme NAME (#47 item 1).

The oracles: the API's signature and the click command themselves (not the config that generates
them); the bytes of an independently made checkpoint (the first run, or the same scheme spelled with
--bits/--group-size/--sym, or quantkit.float_checkpoint.write called directly); the SHA-256 of the
token rows computed here."""
from __future__ import annotations

import hashlib
import inspect
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from torch.utils.data import DataLoader

import quantkit
from quantkit import api, run_config
from quantkit.calibration_sources import tokens_sha256
from quantkit.cli import cli
from quantkit.errors import QuantkitError

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = torch.randint(3, 49152, (4, 32), generator=torch.Generator().manual_seed(7))


def shas(folder: Path) -> dict[str, str]:
    """SHA-256 of every safetensors file of a checkpoint (what "the same bytes" means)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).glob("*.safetensors"))}


def run(*args):
    """`quantkit quantize ARGS` in-process; a QuantkitError propagates (the entry point maps it to exit 2)."""
    result = CliRunner().invoke(cli, ["quantize", *map(str, args), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def recipe_of(folder: Path) -> dict:
    return yaml.safe_load((Path(folder) / "recipe.yaml").read_text())


# --------------------------------------------------------------------------- one declaration, three surfaces


def test_api_keywords_cli_options_and_config_fields_agree():
    sig = inspect.signature(api.quantize)
    assert sorted(sig.parameters) == sorted(run_config.api_keywords())
    command = cli.commands["quantize"]
    assert [p.name for p in command.params if p.name != "help"] == run_config.cli_names()  # declaration order
    for s in run_config.SETTINGS:
        if s.api:
            assert sig.parameters[s.name].default == s.default, s.name
        if s.decls:
            param = next(p for p in command.params if p.name == s.cli_name)
            assert s.flag in param.opts, (s.name, param.opts)
            assert param.help == s.help
    # a CLI-only setting is a method-option shortcut or --json; an API-only one is in-memory or progress
    assert {s.name for s in run_config.SETTINGS if not s.api} == {"desc_act", "static_groups", "mse",
                                                                  "offload_hessians", "as_json"}
    assert {s.name for s in run_config.SETTINGS if not s.decls} == {"tokenizer", "progress"}


def test_help_is_grouped_in_the_config_sections_with_examples():
    out = CliRunner().invoke(cli, ["quantize", "--help"], terminal_width=120).output
    positions = [out.index(f"\n{h}:\n") for h in run_config.SECTIONS]
    assert positions == sorted(positions)
    assert "Other options:" in out and out.count("--num-samples") == 1
    examples = out[out.index("\nExamples:\n"):]
    assert "--recipe ./ckpt/recipe.yaml" in examples and "--scheme nvfp4a16" in examples


@pytest.mark.parametrize("keyword, value, needle", [
    ("num_samples", "8", "num_samples (--num-samples) must be an integer, got '8'"),
    ("sym", "yes", "sym (--sym) must be true or false"),
    ("bits", True, "bits (--bits) must be an integer"),
    ("target_bits", "3.5", "target_bits (--target-bits) must be a number"),
])
def test_a_value_of_the_wrong_type_is_one_line_naming_the_setting(keyword, value, needle, tmp_path):
    with pytest.raises(QuantkitError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")) as err:
        quantkit.quantize("demo", output=tmp_path / "o", progress=False, **{keyword: value})
    assert "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- recipe.yaml


@pytest.fixture(scope="module")
def gptq_checkpoint(tiny_llama_dir, tmp_path_factory) -> Path:
    """GPTQ of the tiny Llama on the bundled corpus, with a method option and a shortcut flag."""
    first = tmp_path_factory.mktemp("recipe") / "first"
    run("--model", tiny_llama_dir, "--method", "gptq", "--group-size", "32", "--num-samples", "4", "--seq-len", "32",
        "--no-desc-act", "--option", "damp_percent=0.02", "--dtype", "float32", "--output", first)
    return first


def test_recipe_yaml_repeats_a_run_with_the_same_bytes(gptq_checkpoint, tiny_llama_dir, tmp_path):
    first, again = gptq_checkpoint, tmp_path / "again"
    rec = recipe_of(first)
    assert rec["method"] == "gptq" and rec["format"] == "gptq"
    assert rec["options"] == {"desc_act": False, "damp_percent": 0.02}
    assert rec["scheme"]["group_size"] == 32 and rec["source"]["model"] == str(Path(tiny_llama_dir).resolve())
    c = rec["calibration"]
    assert (c["dataset"], c["num_samples"], c["seq_len"], c["seed"], c["batch_size"]) == ("lee", 4, 32, 0, 4)
    assert len(c["tokens_sha256"]) == 64 and rec["output"] == {"dtype": "float32", "max_shard_size": "5GB"}
    linears = rec["resolved"]["linears"]
    assert len(linears) == 14 and linears["model.layers.1.mlp.down_proj"] == {"bits": 4, "group_size": 32, "sym": True}
    assert not {"output", "overwrite", "progress"} & set(rec["output"])  # run-time choices are not recorded

    run("--recipe", first / "recipe.yaml", "--output", again)  # the model and everything else from the recipe
    assert shas(again) == shas(first) and shas(first)
    assert recipe_of(again) == rec


def test_recipe_yaml_of_in_memory_data_needs_the_same_tokens(tiny_llama_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    loader = DataLoader([{"input_ids": r} for r in ROWS], batch_size=3)
    first = quantkit.quantize(model, "gptq", tokenizer=tokenizer, group_size=32, dataset=loader,
                              output=tmp_path / "first", progress=False).output
    rec = recipe_of(first)
    c = rec["calibration"]
    assert c["dataset"] is None and c["tokens_sha256"] == tokens_sha256(ROWS) and rec["source"]["model"] is None
    assert "pass the same tokens again" in (first / "recipe.yaml").read_text()
    recipe = first / "recipe.yaml"

    again = quantkit.quantize(tiny_llama_dir, recipe=recipe, dataset=list(ROWS), output=tmp_path / "again",
                              progress=False).output
    assert shas(again) == shas(first)
    with pytest.raises(QuantkitError, match="calibrated on in-memory data .*pass the same tokens again with dataset="):
        quantkit.quantize(tiny_llama_dir, recipe=recipe, output=tmp_path / "none", progress=False)
    other = ROWS.flip(0)
    with pytest.raises(QuantkitError, match=f"SHA-256 {tokens_sha256(ROWS)[:16]}.*these hash to "
                                            f"{tokens_sha256(other)[:16]}"):
        quantkit.quantize(tiny_llama_dir, recipe=recipe, dataset=other, output=tmp_path / "other", progress=False)
    assert not (tmp_path / "none").exists() and not (tmp_path / "other").exists()


def test_recipe_yaml_flags_override_and_a_changed_model_is_refused(tiny_llama_dir, tmp_path):
    first = tmp_path / "first"
    run("--model", tiny_llama_dir, "--method", "rtn", "--bits", "8", "--output", first)
    assert recipe_of(first)["calibration"] is None
    run("--recipe", first / "recipe.yaml", "--bits", "4", "--output", tmp_path / "w4")  # a flag wins
    assert recipe_of(tmp_path / "w4")["scheme"]["bits"] == 4
    # the same path now holds a model whose linears resolve differently: refused, not silently other bytes
    moved = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, moved)
    rec = recipe_of(first)
    rec["source"]["model"] = str(moved)
    rec["resolved"]["linears"]["model.layers.0.mlp.up_proj"]["group_size"] = 32
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(rec))
    with pytest.raises(QuantkitError, match="resolves its linears differently .*model.layers.0.mlp.up_proj"):
        quantkit.quantize(recipe=tmp_path / "edited.yaml", output=tmp_path / "o", progress=False)


def test_a_gguf_folder_holds_its_recipe_and_replays(tiny_llama_dir, tmp_path):
    run("--model", tiny_llama_dir, "--format", "gguf", "--gguf-type", "Q8_0", "--output", tmp_path / "first")
    rec = recipe_of(tmp_path / "first")
    assert (rec["format"], rec["gguf_type"]) == ("gguf", "Q8_0")
    assert {r["grid"] for r in rec["resolved"]["linears"].values()} == {"Q8_0"}
    run("--recipe", tmp_path / "first" / "recipe.yaml", "--output", tmp_path / "again")
    gguf = [(d / "model.gguf").read_bytes() for d in (tmp_path / "first", tmp_path / "again")]
    assert gguf[0] == gguf[1] and len(gguf[0]) > 0


def test_a_moe_run_records_its_expert_policy_and_replays(tiny_llama_dir, tmp_path):
    from test_moe import FAMILIES, build

    source = tmp_path / "moe"
    build(FAMILIES[0]).save_pretrained(source)
    transformers.AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(source)
    run("--model", source, "--method", "gptq", "--group-size", "32", "--num-samples", "4", "--seq-len", "32",
        "--moe-min-tokens", "3", "--output", tmp_path / "first")
    rec = recipe_of(tmp_path / "first")
    assert rec["resolved"]["expert_policy"] == {"mode": "routed", "min_tokens": 3}
    assert (rec["calibration"]["moe_calibration"], rec["calibration"]["moe_min_tokens"]) == ("routed", 3)
    assert any(".experts." in n for n in rec["resolved"]["linears"])
    run("--recipe", tmp_path / "first" / "recipe.yaml", "--output", tmp_path / "again")
    assert shas(tmp_path / "again") == shas(tmp_path / "first")


def test_a_size_budgets_mixture_is_in_the_recipe_and_replays_without_measuring(tiny_llama_dir, tmp_path):
    report = tmp_path / "report"
    api.sensitivity(str(tiny_llama_dir), "gptq", group_size=32, num_samples=4, seq_len=32, eval_windows=2,
                    eval_seq_len=32, candidate_bits=(2, 4, 8), output=report, progress=False)
    first = quantkit.quantize(str(tiny_llama_dir), "gptq", group_size=32, num_samples=4, seq_len=32,
                              output=tmp_path / "mix", target_bits=3.5, sensitivity=report, progress=False).output
    rec = recipe_of(first)
    bits = {r["bits"] for r in rec["resolved"]["linears"].values()}
    assert len(bits) > 1 and rec["scheme"]["overrides"] and rec["resolved"]["allocation"]
    shutil.rmtree(report)  # the replay reads the mixture from the recipe, not the report
    run("--recipe", first / "recipe.yaml", "--output", tmp_path / "again")
    assert shas(tmp_path / "again") == shas(first)


@pytest.mark.parametrize("where, key", [(None, "bogus"), ("calibration", "tokens_hash"), ("resolved", "linear"),
                                        ("source", "trust_remote_code"), ("output", "folder"), ("scheme", "bitz")])
def test_an_unknown_key_in_recipe_yaml_is_refused(gptq_checkpoint, tmp_path, where, key):
    first = gptq_checkpoint
    rec = recipe_of(first)
    (rec if where is None else rec[where])[key] = 1
    bad = tmp_path / "recipe.yaml"
    bad.write_text(yaml.safe_dump(rec))
    section = "" if where is None else f" section '{where}'"
    with pytest.raises(QuantkitError, match=rf"recipe .*recipe.yaml{section} has unknown keys \['{key}'\]; allowed: ") as e:
        quantkit.quantize(recipe=bad, output=tmp_path / "o", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- --scheme NAME


@pytest.fixture(scope="module")
def tiny_wide_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """A 2-layer random Llama whose linears take 128 inputs or more (presets' groups of 128 divide them)."""
    out = tmp_path_factory.mktemp("tiny-wide")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=49152, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(out)
    return out


def test_an_integer_scheme_is_its_flags(tiny_wide_dir, tmp_path):
    run("--model", tiny_wide_dir, "--scheme", "w4a16", "--output", tmp_path / "named")
    run("--model", tiny_wide_dir, "--bits", "4", "--group-size", "128", "--sym", "--format", "compressed-tensors",
        "--output", tmp_path / "flags")
    assert shas(tmp_path / "named") == shas(tmp_path / "flags")
    assert recipe_of(tmp_path / "named")["resolved"]["preset"] == "W4A16"
    run("--recipe", tmp_path / "named" / "recipe.yaml", "--output", tmp_path / "again")
    assert shas(tmp_path / "again") == shas(tmp_path / "named")
    assert recipe_of(tmp_path / "again") == recipe_of(tmp_path / "named")  # the preset's name kept


def test_a_float_scheme_is_float_checkpoints_rtn_and_replays(tiny_wide_dir, tmp_path):
    from quantkit import float_checkpoint
    from quantkit.scheme_presets import preset

    run("--model", tiny_wide_dir, "--scheme", "NVFP4A16", "--output", tmp_path / "named")
    float_checkpoint.write(transformers.AutoModelForCausalLM.from_pretrained(tiny_wide_dir), preset("nvfp4a16"),
                           tmp_path / "direct")
    assert shas(tmp_path / "named") == shas(tmp_path / "direct")
    rec = recipe_of(tmp_path / "named")
    assert (rec["scheme"], rec["method"], rec["format"]) == ("NVFP4A16", "rtn", "compressed-tensors")
    assert (tmp_path / "named" / "tokenizer.json").is_file()
    run("--recipe", tmp_path / "named" / "recipe.yaml", "--output", tmp_path / "again")
    assert shas(tmp_path / "again") == shas(tmp_path / "named")


def test_a_float_scheme_with_gptq_is_float_checkpoints_gptq_and_replays(tiny_wide_dir, tmp_path):
    """--scheme NVFP4A16 --method gptq runs float_checkpoint's GPTQ on the float grid with the run's tokens."""
    from quantkit import float_checkpoint
    from quantkit.scheme_presets import preset

    ids = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(7))
    quantkit.quantize(str(tiny_wide_dir), "gptq", scheme="nvfp4a16", dataset=ids, batch_size=4,
                      options={"damp_percent": 0.02}, output=tmp_path / "named", progress=False)
    float_checkpoint.write(transformers.AutoModelForCausalLM.from_pretrained(tiny_wide_dir), preset("nvfp4a16"),
                           tmp_path / "direct", method="gptq", calibration=ids, options={"damp_percent": 0.02},
                           batch_size=4)
    assert shas(tmp_path / "named") == shas(tmp_path / "direct")
    float_checkpoint.write(transformers.AutoModelForCausalLM.from_pretrained(tiny_wide_dir), preset("nvfp4a16"),
                           tmp_path / "rtn")
    assert shas(tmp_path / "rtn") != shas(tmp_path / "named")  # GPTQ moved codes
    rec = recipe_of(tmp_path / "named")
    assert (rec["scheme"], rec["method"], rec["options"]) == ("NVFP4A16", "gptq", {"damp_percent": 0.02})
    assert rec["calibration"]["tokens_sha256"] == tokens_sha256(ids)
    quantkit.quantize(recipe=tmp_path / "named" / "recipe.yaml", dataset=ids, output=tmp_path / "again",
                      progress=False)
    assert shas(tmp_path / "again") == shas(tmp_path / "named")


def test_a_recipe_file_may_name_its_scheme(tmp_path):
    from quantkit.plan import resolve_plan

    path = tmp_path / "r.yaml"
    path.write_text("method: gptq\nscheme: w8a16\ncalibration: {num_samples: 8}\n")
    plan = resolve_plan(recipe_file=path)
    assert plan.preset.name == "W8A16" and plan.recipe.name == "gptq" and plan.format == "compressed-tensors"
    assert (plan.scheme.bits, plan.scheme.group_size, plan.scheme.sym) == (8, 128, True)
    assert resolve_plan(recipe_file=path, scheme="W4A16").scheme.bits == 4  # the flag wins
    with pytest.raises(QuantkitError, match="--scheme W8A16 quantizes weights to 8 bits, not --bits 4"):
        resolve_plan(recipe_file=path, bits=4)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(scheme="w4a16", bits=8), "--scheme W4A16 quantizes weights to 4 bits, not --bits 8; drop --bits"),
    (dict(scheme="W8A16", group_size=64), "not --group-size 64"),
    (dict(scheme="w4a16", sym=False), "--scheme W4A16 is symmetric; drop --sym/--asym"),
    (dict(scheme="nvfp4a16", method="rtn,signround"), "written by --method rtn, gptq, gptq+signround, smoothquant, "
                                                        "smoothquant+gptq, smoothquant+gptq+signround, awq, awq+gptq, "
                                                        "awq+gptq+signround; drop --method rtn+signround"),
    (dict(scheme="nvfp4a16", method="gptq", options={"static_groups": False}), "float grid takes only damp_percent"),
    (dict(scheme="nvfp4a16", options={"mse": False}), "with round-to-nearest takes no method options"),
    (dict(scheme="w4a16", kv_cache_scheme="int8"), "--kv-cache-scheme 'int8' is not a KV-cache scheme"),
    (dict(format="gptq", kv_cache_scheme="fp8"), "the gptq format has no place for KV-cache scales"),
    (dict(scheme="w8a8", method="gptq"), "quantizes activations; method 'gptq' does not"),
    (dict(scheme="nope"), "unknown scheme 'nope'; choose one of"),
])
def test_scheme_refusals_are_one_line(kwargs, needle, tmp_path):
    with pytest.raises(QuantkitError) as err:
        quantkit.quantize("demo", output=tmp_path / "o", progress=False, **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


def test_scheme_disagreeing_with_a_flag_exits_2_on_the_command_line(tmp_path):
    from conftest import run_cli

    proc = run_cli("quantize", "--scheme", "W4A16", "--group-size", "32", "--output", tmp_path / "o")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: --scheme W4A16 quantizes weights groups of 128, not --group-size 32; drop --group-size"]


def test_a_step_of_the_callers_own_writes_its_recipe_yaml(tiny_llama_dir, tmp_path):
    """`quantize(method=MyStep(...))`: a Step class registered by no name still gets a recipe.yaml that
    names it and its non-default options (measured against the class's own declared defaults)."""
    from quantkit.quantizers.base import Quantizer
    from quantkit.quantizers.grid import rtn_quantize

    class ScaledRTN(Quantizer):
        name = "scaled-rtn-of-my-own"
        options_spec = {"factor": 1.0}

        def quantize_linear(self, name, module, scheme):
            w = module.weight.data * float(self.options["factor"])
            return rtn_quantize(w, scheme.bits, scheme.group_size, scheme.sym, module.bias)

    quantkit.quantize(str(tiny_llama_dir), ScaledRTN(factor=1.5), group_size=32, output=tmp_path / "mine",
                      progress=False)
    rec = recipe_of(tmp_path / "mine")
    assert (rec["method"], rec["options"]) == ("scaled-rtn-of-my-own", {"factor": 1.5})
