"""Usage counts from an upstream, which is untrusted input."""

from __future__ import annotations

from typing import Any

# A token count above this is not a count (and would overflow a Redis counter in time).
MAX_TOKEN_COUNT = 1 << 40


def token_count(value: Any) -> int:
    """A usage field from upstream: anything but a non-negative integer (a string, a float, a
    negative or absurd number, nested junk) counts as 0, alone."""
    if type(value) is int and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return 0
