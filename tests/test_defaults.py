"""The defaults are what docs/defaults.yaml says: a bare `--method X` resolves to them.

docs/defaults.yaml is the product's statement of its defaults, each with the figure that chose it
(docs/methods.md shows it); this test resolves each method's plan with no other argument, as
`quantkit quantize --method X` does, and compares every setting the file names. It also checks that
the page's defaults section is the one scripts/render_defaults_doc.py writes from the file.
"""
import importlib.util
from pathlib import Path

import pytest

from quantkit.plan import resolve_plan

ROOT = Path(__file__).resolve().parents[1]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_defaults_doc", ROOT / "scripts" / "render_defaults_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RENDER = _renderer()
DATA = RENDER.load_defaults()


def stated_defaults() -> list[tuple[str, str, object]]:
    return [(e["method"], setting, value) for e in DATA["defaults"] for setting, value in e["settings"].items()]


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


def test_the_file_states_the_defaults_of_every_method_it_measures():
    methods = {m for m, _, _ in stated_defaults()}
    assert {"gptq", "awq", "rtn"} <= methods, methods
    assert len(stated_defaults()) >= 20
    assert all(e["why"].strip() for e in DATA["defaults"]), "every default carries the measurement behind it"


@pytest.mark.parametrize("method,setting,stated", stated_defaults())
def test_bare_method_resolves_to_the_stated_default(method, setting, stated):
    assert resolved(method, setting) == stated


def test_methods_page_shows_the_current_file():
    page = RENDER.PAGE.read_text()
    assert RENDER.current_section(page) == RENDER.render(DATA), \
        "docs/methods.md is out of date with docs/defaults.yaml: run python scripts/render_defaults_doc.py"
