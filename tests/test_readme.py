"""The README is part of the interface: its two commands and its settings table must match the
code and CI."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.config.help import settings_variables
from gateway.config.settings import OTHER_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_setting_is_in_the_table():
    documented = set(re.findall(r"^\| `(FIRSTTOKEN_[A-Z_]+)`", README, re.MULTILINE))
    declared = {variable.name for variable in settings_variables()}  # what `serve --help` lists
    assert declared - documented == set(), "settings missing from the README table"
    extra = documented - declared - {f"FIRSTTOKEN_{name}" for name in OTHER_VARIABLES}
    assert extra == set(), "README documents settings the code does not have"


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^make (\w+)", README.split("```", 2)[1], re.MULTILINE)
    assert commands == ["run", "test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()
