"""Rewrites the flag table in README.md from asr-server's own parser, so the README lists
every flag with its real default. tests/test_readme.py fails when the table is stale.

    python scripts/gen_readme_flags.py
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from service.config import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- flags:begin (scripts/gen_readme_flags.py) -->", "<!-- flags:end -->"


def flag_table() -> str:
    parser = build_parser()
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for group in parser._action_groups:
        for action in group._group_actions:
            if (
                isinstance(action, argparse._HelpAction)
                or not action.option_strings
                or action.help == argparse.SUPPRESS  # test seams stay out of the README as out of --help
            ):
                continue
            default = action.default
            if isinstance(default, bool):
                default = "on" if default else "off"
            help_text = (action.help or "").replace("%(default)s", str(default)).replace("%%", "%")
            help_text = help_text.replace("|", "\\|")
            rows.append(f"| `{action.option_strings[-1]}` | `{default}` | {help_text} |")
    return "\n".join(rows)


def render(readme: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    return pattern.sub(lambda _: f"{BEGIN}\n{flag_table()}\n{END}", readme)


if __name__ == "__main__":
    README.write_text(render(README.read_text()))
