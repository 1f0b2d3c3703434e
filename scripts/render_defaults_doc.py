#!/usr/bin/env python
"""Write the defaults section of docs/methods.md from docs/defaults.yaml, the one statement of them.

The YAML file holds every default of a bare `quantkit quantize --method X` with the measurement
that chose it; tests/test_defaults.py checks the registered defaults against it and that the
section this script writes is current, so the page and the data cannot drift apart.

    python scripts/render_defaults_doc.py            # rewrite the section in docs/methods.md
    python scripts/render_defaults_doc.py --check    # exit 1 if the section is out of date
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ROOT / "docs" / "defaults.yaml"
PAGE = ROOT / "docs" / "methods.md"
BEGIN = "<!-- defaults: written by scripts/render_defaults_doc.py from docs/defaults.yaml; do not edit -->"
END = "<!-- end of defaults -->"
WIDTH = 100


def load_defaults(path: Path = DEFAULTS) -> dict:
    return yaml.safe_load(path.read_text())


def _value(v) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def _settings(entry: dict) -> str:
    return ", ".join(f"`{k}` = `{_value(v)}`" for k, v in entry["settings"].items())


def render(data: dict) -> str:
    """The markdown section: how the figures were measured, a summary table, then each default's why."""
    wrap = lambda text, **kw: textwrap.fill(" ".join(text.split()), WIDTH, break_long_words=False,  # noqa: E731
                                            break_on_hyphens=False, **kw)
    out = [BEGIN, "", wrap(data["measured_on"]), "", "| method | setting | default |", "|---|---|---|"]
    for e in data["defaults"]:
        for k, v in e["settings"].items():
            out.append(f"| {e['method']} | `{k}` | `{_value(v)}` |")
    out.append("")
    for e in data["defaults"]:
        out.append(wrap(f"**{e['method']}** {_settings(e)}: {e['why']}", initial_indent="- ", subsequent_indent="  "))
    out += ["", END]
    return "\n".join(out)


def current_section(page: str) -> str:
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{PAGE} has no defaults section (the markers {BEGIN!r} ... {END!r})")
    return page[start:end + len(END)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/methods.md's section is out of date")
    args = ap.parse_args(argv)
    page = PAGE.read_text()
    old, new = current_section(page), render(load_defaults())
    if args.check:
        if old != new:
            print(f"{PAGE} is out of date with {DEFAULTS}: run python scripts/render_defaults_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page.replace(old, new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
