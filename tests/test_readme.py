"""The README documents every server flag (generated from the parser) and opens with the
two commands that set up a fresh machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from scripts.gen_readme_flags import README, render

REPO = Path(__file__).resolve().parents[1]


def test_flag_table_is_current() -> None:
    text = README.read_text()
    assert render(text) == text, "README flag table is stale: run python scripts/gen_readme_flags.py"


def test_every_flag_in_help_is_in_the_readme() -> None:
    help_text = subprocess.run(
        [str(REPO / ".venv" / "bin" / "asr-server"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", help_text)) - {"--help"}
    assert flags, "no flags found in --help"
    missing = sorted(f for f in flags if f"`{f}`" not in README.read_text())
    assert not missing, f"flags missing from README: {missing}"


def test_readme_opens_with_the_setup_and_test_commands() -> None:
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", README.read_text(), re.S)
    assert "scripts/setup.sh" in blocks[0] and "asr-server" in blocks[0]
    assert blocks[1].strip() == "scripts/test.sh"
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_every_path_in_what_is_where_exists() -> None:
    # the table is how a reader finds a file: after a module moves, a stale row sends them nowhere
    text = README.read_text()
    table = text[text.index("## What is where") : text.index("\n## ", text.index("## What is where") + 1)]
    paths = set(
        re.findall(r"`((?:service|engine|clients|proto|harness|scripts|tests|deploy|docs)/[\w./-]*)`", table)
    )
    assert len(paths) > 30, "the table names no paths: the pattern above is stale"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"README 'What is where' names paths that do not exist: {missing}"
