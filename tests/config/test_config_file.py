"""`--config firsttoken.toml`: the same keys as the variables, lower-case without the prefix;
a variable that is set overrides the file."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import pytest

from gateway.config.settings import SettingsError, load_settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

CONFIG = """
timeout_s = 120
retry_attempts = 3
policies = ["slim", "canonicalize"]
slim_minify_json = true
ttft_slo_tenants = { acme = 800 }

[[routes]]
name = "vllm"
models = ["llama-*"]
kind = "openai"
base_url = "http://127.0.0.1:8000/v1"
api_key_env = "VLLM_KEY"
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "firsttoken.toml"
    path.write_text(CONFIG)
    return path


def test_the_file_is_loaded_into_typed_settings(config):
    settings = load_settings(environ={"VLLM_KEY": "sk-v"}, config_file=config)
    assert settings.timeout_s == 120 and settings.retry_attempts == 3
    assert settings.policies == ("slim", "canonicalize")
    assert settings.policy_options.slim.minify_json is True
    assert settings.ttft_slo_tenants == {"acme": 800.0}
    (route,) = settings.routes
    assert route.name == "vllm" and settings.route_api_key(route) == "sk-v"


def test_variables_override_the_file(config):
    settings = load_settings(
        environ={
            "FIRSTTOKEN_TIMEOUT_S": "30",
            "FIRSTTOKEN_SLIM_MINIFY_JSON": "false",
            "FIRSTTOKEN_ROUTES": '[{"name": "env", "models": ["*"], "kind": "local"}]',
        },
        config_file=config,
    )
    assert settings.timeout_s == 30  # the variable
    assert settings.retry_attempts == 3  # the file, where no variable is set
    assert settings.policy_options.slim.minify_json is False
    assert [r.name for r in settings.routes] == ["env"]


def test_an_unknown_key_in_the_file_is_a_warning_with_a_suggestion(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="firsttoken")
    path = tmp_path / "f.toml"
    path.write_text("timeout = 5\n")
    assert load_settings(environ={}, config_file=path).timeout_s == 600
    messages = [r.getMessage() for r in caplog.records if r.name == "firsttoken"]
    assert any("'timeout'" in m and str(path) in m and "timeout_s?" in m for m in messages)


@pytest.mark.parametrize(
    "text, named",
    [
        ('max_body_bytes = "lots"\n', "max_body_bytes in {path}: Input should be"),
        # a validator's own message names the variable: the file's key replaces it
        ('tenant_keys = "no-colon"\n', "tenant_keys in {path}:"),
        ('[[routes]]\nname = "r"\nmodels = ["*"]\nkind = "nope"\n', "routes[0].kind in {path}:"),
    ],
)
def test_a_bad_value_in_the_file_is_named_by_the_files_key(tmp_path, text, named):
    path = tmp_path / "f.toml"
    path.write_text(text)
    with pytest.raises(SettingsError) as err:
        load_settings(environ={}, config_file=path)
    assert named.format(path=path) in str(err.value)
    assert "FIRSTTOKEN_" not in str(err.value)


def test_a_bad_variable_over_the_file_is_named_by_the_variable(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text("max_body_bytes = 1000\n")
    with pytest.raises(SettingsError, match=r"^FIRSTTOKEN_MAX_BODY_BYTES: "):
        load_settings(environ={"FIRSTTOKEN_MAX_BODY_BYTES": "lots"}, config_file=path)


@pytest.mark.parametrize(
    "text, problem", [("timeout_s = ", "not valid TOML"), (None, "cannot read it")]
)
def test_a_broken_or_missing_file_is_a_clear_error(tmp_path, text, problem):
    path = tmp_path / "f.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SettingsError) as err:
        load_settings(environ={}, config_file=path)
    assert str(err.value).startswith(f"--config {path}: {problem}")


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML not installed")
def test_yaml_is_read_where_pyyaml_is_installed(tmp_path):
    path = tmp_path / "firsttoken.yaml"
    path.write_text("timeout_s: 45\npolicies: none\n")
    settings = load_settings(environ={}, config_file=path)
    assert settings.timeout_s == 45 and settings.policies == ()


def test_the_readme_example_loads(tmp_path):
    (example,) = re.findall(r"```toml\n(.*?)```", README, re.DOTALL)
    path = tmp_path / "firsttoken.toml"
    path.write_text(example)
    settings = load_settings(environ={}, config_file=path)
    assert settings.routes is not None and settings.routes[0].base_url
