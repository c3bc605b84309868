"""`firsttoken --version`, and `serve --help` listing every variable with its default, from the
settings model itself so that the list cannot drift."""

from __future__ import annotations

from importlib import metadata

import pytest

from gateway.cli import main
from gateway.config.help import settings_variables
from gateway.config.settings import Settings
from policies import KNOWN_OPTIONS
from tests.support.cli import serve_refusal


def help_text(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"firsttoken {metadata.version('firsttoken')}"


def test_serve_help_lists_every_field_with_its_default(capsys):
    lines = help_text(capsys).splitlines()
    by_name = {v.name: v for v in settings_variables()}
    not_variables = {"policy_options", "captured_env"}  # their variables are listed apart
    for name, field in Settings.model_fields.items():
        if name in not_variables:
            continue
        variable = f"FIRSTTOKEN_{name.upper()}"
        line = next((line for line in lines if line.strip().startswith(variable + " ")), None)
        assert line is not None, f"{variable} missing from serve --help"
        assert f"(default: {by_name[variable].default})" in line
        assert field.description, f"{name} has no description to show"
    for option in KNOWN_OPTIONS:
        assert any(line.strip().startswith(f"FIRSTTOKEN_{option} ") for line in lines)


def test_help_shows_defaults_as_an_operator_writes_them(capsys):
    text = help_text(capsys)
    assert "FIRSTTOKEN_TIMEOUT_S  (default: 600)" in text
    assert "FIRSTTOKEN_ALLOW_CLIENT_POLICIES  (default: true)" in text
    assert "FIRSTTOKEN_POLICIES  (default: slim,canonicalize,cache_hints)" in text
    assert "FIRSTTOKEN_ENGINE_MAX_NUM_BATCHED_TOKENS  (default: unset)" in text
    assert "--config" in text


def test_serve_reads_the_config_file_and_exits_2_naming_the_files_key(tmp_path):
    path = tmp_path / "firsttoken.toml"
    path.write_text("keepalive_s = -1\n")
    assert f"keepalive_s in {path}: " in serve_refusal("--config", str(path))


def test_serve_help_describes_host_and_port(capsys):
    text = help_text(capsys)
    for option in ("--host", "--port"):
        (line,) = [line for line in text.splitlines() if line.strip().startswith(option)]
        described = line.split(option, 1)[1].split(None, 1)  # metavar, then the help
        assert len(described) == 2 and "default" in described[1], line
