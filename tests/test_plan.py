"""The resolved plan: every flag used or refused, numbers parsed as numbers, recipe sections validated."""
import pytest

from conftest import last_json, run_cli
from quantkit.errors import QuantkitError
from quantkit.plan import parse_option_value, read_recipe_file, resolve_plan


def test_option_values_are_numbers_where_python_reads_numbers():
    assert parse_option_value("1e-2") == 0.01 and isinstance(parse_option_value("1e-2"), float)
    assert parse_option_value("20") == 20 and isinstance(parse_option_value("20"), int)
    assert parse_option_value("true") is True and parse_option_value("auto") == "auto"
    plan = resolve_plan("gptq", options={"damp_percent": parse_option_value("1e-2")})
    assert plan.recipe.quantizer.options["damp_percent"] == 0.01


def test_calibration_flags_for_a_method_that_reads_no_data_are_refused():
    for flags in ({"dataset": "wiki"}, {"num_samples": 16}, {"seq_len": 64}, {"seed": 3}, {"chat_template": True},
                  {"batch_size": 2}):
        with pytest.raises(QuantkitError, match="reads no calibration data.*--" + next(iter(flags)).replace("_", "-")):
            resolve_plan("rtn", calibration=flags)
    assert resolve_plan("rtn").calibration is None
    assert "seed" not in resolve_plan("rtn").method_info()  # the card records only what was used
    plan = resolve_plan("gptq", calibration={"seed": 3, "num_samples": 16})
    assert (plan.calibration.seed, plan.calibration.num_samples, plan.calibration.seq_len) == (3, 16, 512)
    assert plan.method_info()["seed"] == 3


def test_recipe_sections_are_validated(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: gptq\ncalibration:\n  num_sample: 64\n")
    with pytest.raises(QuantkitError, match=r"section 'calibration' has unknown keys \['num_sample'\]"):
        read_recipe_file(bad)
    bad.write_text("method: gptq\noptions:\n  damp: 0.1\n")
    with pytest.raises(QuantkitError, match=r"unknown option\(s\) \['damp'\] for method 'gptq'"):
        resolve_plan(recipe_file=bad)
    bad.write_text("method: rtn\ncalibration:\n  dataset: wiki\n")
    with pytest.raises(QuantkitError, match="reads no calibration data"):
        resolve_plan(recipe_file=bad)


def test_methods_compose_and_options_go_to_the_step_that_declares_them():
    plan = resolve_plan("awq,gptq", options={"n_grid": 10, "damp_percent": 0.05})
    awq, gptq = plan.recipe.steps
    assert (awq.name, gptq.name) == ("awq", "gptq") and awq.options["n_grid"] == 10
    assert gptq.options["damp_percent"] == 0.05 and plan.recipe.name == "awq+gptq"
    assert [s.name for s in resolve_plan("awq").recipe.steps] == ["awq", "rtn"]
    with pytest.raises(QuantkitError, match="one weight quantizer"):
        resolve_plan("gptq,rtn")


def test_options_with_a_ready_step_instance_are_refused():
    from quantkit.quantizers.gptq import GPTQQuantizer

    with pytest.raises(QuantkitError, match="pass them to its constructor"):
        resolve_plan(GPTQQuantizer(), options={"damp_percent": 0.05})
    assert resolve_plan(GPTQQuantizer(damp_percent=0.05)).recipe.quantizer.options["damp_percent"] == 0.05


def test_cli_refuses_an_ignored_flag_in_one_line(tmp_path):
    proc = run_cli("quantize", "--method", "rtn", "--dataset", "wiki", "--output", tmp_path / "x")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "reads no calibration data, so --dataset would be ignored" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_cli_option_reaches_the_step_as_a_float(tiny_llama_dir, tmp_path):
    out = tmp_path / "g"
    proc = run_cli("quantize", "--model", tiny_llama_dir, "--method", "gptq", "--group-size", "32", "--num-samples", "2",
                   "--seq-len", "32", "--option", "damp_percent=1e-2", "--output", out, "--json")
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["method"] == "gptq"
    import json

    assert json.loads((out / "config.json").read_text())["quantization_config"]["damp_percent"] == 0.01


def test_rtn_searches_its_ranges_but_a_transform_is_finished_on_the_plain_grid():
    """A bare --method rtn searches each group's range (the default, README); awq and smoothquant,
    whose own searches simulate plain min/max rounding, are finished by RTN on that same grid unless
    the option is given."""
    from quantkit.quantizers.recipe import Recipe, build_recipe
    from quantkit.quantizers.base import get_quantizer

    assert resolve_plan(method="rtn").recipe.quantizer.options["mse"] is True
    for method in ("awq", "smoothquant"):
        recipe = resolve_plan(method=method).recipe
        assert recipe.quantizer.name == "rtn" and recipe.quantizer.options["mse"] is False, method
    assert build_recipe("awq", {"mse": True}).quantizer.options["mse"] is True
    assert Recipe.of(get_quantizer("awq")).quantizer.options["mse"] is False


def test_awq_is_finished_on_the_symmetric_grid_its_search_simulates():
    """AWQ's searches simulate AutoAWQ's symmetric grid (sym_range "exact"); its finishing RTN rounds on
    that grid, and a user's sym_range reaches both (it is AWQ's option: no 'belongs to several steps')."""
    from quantkit.quantizers.base import get_quantizer
    from quantkit.quantizers.recipe import Recipe, build_recipe

    assert resolve_plan(method="rtn").recipe.quantizer.options["sym_range"] == "centred"
    assert resolve_plan(method="smoothquant").recipe.quantizer.options["sym_range"] == "centred"
    awq = resolve_plan(method="awq").recipe
    assert awq.transforms[0].options["sym_range"] == "exact" == awq.quantizer.options["sym_range"]
    assert Recipe.of(get_quantizer("awq")).quantizer.options["sym_range"] == "exact"
    centred = build_recipe("awq", {"sym_range": "centred"})
    assert centred.transforms[0].options["sym_range"] == "centred" == centred.quantizer.options["sym_range"]
    # in awq,gptq both steps declare it (GPTQ's grid has a sym_range too, e.g. "full"): refused, not guessed
    with pytest.raises(QuantkitError, match="'sym_range' belongs to several steps"):
        build_recipe("awq,gptq", {"sym_range": "centred"})
    assert build_recipe("awq,gptq", {}).transforms[0].options["sym_range"] == "exact"
    assert build_recipe("awq,gptq", {}).quantizer.options["sym_range"] == "centred"
    with pytest.raises(QuantkitError, match="sym_range must be one of centred, exact"):
        build_recipe("awq", {"sym_range": "half"})
    with pytest.raises(QuantkitError, match="sym_range must be one of centred, exact"):
        build_recipe("rtn", {"sym_range": "half"})
