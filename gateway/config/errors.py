"""The configuration's one error, in a module of its own so that every part of `gateway.config`
(the file reader, the settings) can raise it without importing each other."""

from __future__ import annotations


class SettingsError(ValueError):
    """A start-up configuration error whose message names the variable at fault."""
