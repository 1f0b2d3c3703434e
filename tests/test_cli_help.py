"""`quantize --help` lists its options under headings, each exactly once, and ends with examples."""
from click.testing import CliRunner

from quantkit.cli import QUANTIZE_HELP_SECTIONS, cli


def test_quantize_help_groups_every_option_once_and_shows_examples():
    out = CliRunner().invoke(cli, ["quantize", "--help"], terminal_width=120)
    assert out.exit_code == 0, out.output
    text = out.output
    headings = [h for h, _ in QUANTIZE_HELP_SECTIONS]
    positions = [text.index(f"\n{h}:\n") for h in headings]
    assert positions == sorted(positions), "sections print in the declared order"
    assert text.index("\nExamples:\n") > positions[-1]
    command = cli.commands["quantize"]
    for param in command.params:
        for flag in param.opts:
            assert text.count(f"  {flag} ") + text.count(f"  {flag},") + text.count(f"{flag} /") + \
                text.count(f"/ {flag}") >= 1, flag
    named = [n for _, names in QUANTIZE_HELP_SECTIONS for n in names]
    assert len(named) == len(set(named)), "an option named in two sections"
    assert set(named) <= {p.name for p in command.params}, "a section names an option the command does not have"
    # everything the command has is in a named section (only --help falls to "Other options")
    assert {p.name for p in command.params} - set(named) == set(), "an option missing from QUANTIZE_HELP_SECTIONS"
