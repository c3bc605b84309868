"""The one error every translator raises for a request it cannot express."""

from __future__ import annotations


class TranslationError(ValueError):
    """A request that cannot be expressed for the route's API; the gateway answers it with a
    400 naming `param`, the field the client sent."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
