"""What there is to set: every `FIRSTTOKEN_*` variable with its default and description, from
the `Settings` model and the policies' option table, so the list cannot drift from the code.
`firsttoken serve --help` prints it and the README's table is checked against it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config.settings import ENV_PREFIX, NOT_VARIABLES, Settings
from policies.config import option_docs


@dataclass(frozen=True)
class Variable:
    name: str  # FIRSTTOKEN_...
    default: str  # as an operator would write it; "unset" when there is none
    description: str


def settings_variables() -> list[Variable]:
    """Every FIRSTTOKEN_* variable the gateway reads, with its default and description: the
    Settings fields, then each policy option. `serve --help` prints this list."""
    out = []
    for name, field in Settings.model_fields.items():
        if name in NOT_VARIABLES:
            continue
        default = field.get_default(call_default_factory=True)
        out.append(
            Variable(ENV_PREFIX + name.upper(), _shown_default(default), field.description or "")
        )
    for key, default, doc in option_docs():
        out.append(Variable(ENV_PREFIX + key, _shown_default(default), doc))
    return out


def _shown_default(value: object) -> str:
    if value is None or value == "" or (isinstance(value, Iterable) and not value):
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
