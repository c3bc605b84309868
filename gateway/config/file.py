"""The optional configuration file (`firsttoken serve --config firsttoken.toml`): the same
keys as the `FIRSTTOKEN_*` variables, lower-case and without the prefix, for people who keep
configuration in git. The environment overrides the file (`gateway.config.settings.load_settings`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from gateway.config.errors import SettingsError


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML file (YAML too when PyYAML is installed) of the same keys as the variables,
    lower-case and without the prefix. Raises `SettingsError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"--config {path}: cannot read it ({exc.strerror})") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        data = _yaml(path, text)
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"--config {path}: not valid TOML ({exc})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path}: expected a table of settings")
    return data


def _yaml(path: Path, text: str) -> object:
    try:
        import yaml  # type: ignore[import-untyped]  # PyYAML ships no types; optional
    except ImportError:
        raise SettingsError(
            f"--config {path}: YAML needs PyYAML (pip install pyyaml); or write the file in TOML"
        ) from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise SettingsError(f"--config {path}: not valid YAML ({exc})") from None
