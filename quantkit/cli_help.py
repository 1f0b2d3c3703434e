"""`--help` in sections: a click command whose options print under headings, then examples.

click has no option groups; a command with dozens of options listed in declaration order hides the
few a newcomer needs. `SectionedCommand` only changes how help is printed: parsing is click's own.
An option no section names is listed under "Other options", so a new option is never hidden.
"""
from __future__ import annotations

import click


class SectionedCommand(click.Command):
    def __init__(self, *args, sections: tuple[tuple[str, tuple[str, ...]], ...] = (), examples: tuple[str, ...] = (),
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = sections  # (heading, parameter names as click names them), in print order
        self.examples = examples  # command lines, printed as written (no rewrapping)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        rows = {name: row for name, row in rows.items() if row is not None}
        for heading, names in self.sections:
            section = [rows.pop(n) for n in names if n in rows]
            if section:
                with formatter.section(heading):
                    formatter.write_dl(section)
        if rows:
            with formatter.section("Other options"):
                formatter.write_dl(list(rows.values()))

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:
                    formatter.write(f"{'':>{formatter.current_indent}}{line}\n")
        super().format_epilog(ctx, formatter)
