"""The defaults are what the README's defaults table says: a bare `--method X` resolves to them.

The table (README, "Defaults and the measurements behind them") is the product's statement of its
defaults, each with the figure that chose it; this test reads it and resolves each method's plan
with no other argument, as `quantkit quantize --method X` does.
"""
import re
from pathlib import Path

import pytest
import yaml

from quantkit.plan import resolve_plan

README = Path(__file__).resolve().parents[1] / "README.md"
ROW = re.compile(r"^\|\s*(\w+)\s*\|\s*`(\w+)`\s*\|\s*`([^`]+)`\s*\|")


def readme_defaults() -> list[tuple[str, str, object]]:
    text = README.read_text()
    section = text.split("## Defaults and the measurements behind them", 1)[1].split("\n## ", 1)[0]
    rows = [ROW.match(line) for line in section.splitlines()]
    return [(m[1], m[2], yaml.safe_load(m[3])) for m in rows if m]


def resolved(method: str, setting: str):
    plan = resolve_plan(method)
    for step in plan.recipe.steps:
        if setting in step.options:
            return step.options[setting]
    if setting in ("bits", "group_size", "sym"):
        return getattr(plan.scheme, setting)
    if setting == "format":
        return plan.format
    return getattr(plan.calibration, setting)


def test_readme_states_the_defaults_of_every_method_it_measures():
    methods = {m for m, _, _ in readme_defaults()}
    assert {"gptq", "awq", "rtn"} <= methods, methods
    assert len(readme_defaults()) >= 10


@pytest.mark.parametrize("method,setting,stated", readme_defaults())
def test_bare_method_resolves_to_the_readme_default(method, setting, stated):
    assert resolved(method, setting) == stated
