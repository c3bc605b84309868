"""firsttoken gateway: an OpenAI-compatible proxy built for time-to-first-token."""

__version__ = "0.1.0"
