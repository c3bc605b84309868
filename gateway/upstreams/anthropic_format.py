"""Translation between OpenAI chat completions and Anthropic's Messages API: the one import for
the `anthropic` upstream kind.

The work is split by direction: requests going up live in `anthropic_request`, everything coming
back (whole responses, stream events, error bodies) in `anthropic_stream`. All of it is pure.
"""

from gateway.upstreams.anthropic_request import (
    ANTHROPIC_NATIVE_FIELDS,
    DEFAULT_MAX_TOKENS,
    DROPPED_FIELDS,
    TranslationError,
    to_anthropic_request,
)
from gateway.upstreams.anthropic_stream import (
    AnthropicStreamError,
    AnthropicStreamTranslator,
    error_to_openai,
    finish_reason,
    openai_usage,
    to_openai_response,
)

__all__ = [
    "ANTHROPIC_NATIVE_FIELDS",
    "DEFAULT_MAX_TOKENS",
    "DROPPED_FIELDS",
    "AnthropicStreamError",
    "AnthropicStreamTranslator",
    "TranslationError",
    "error_to_openai",
    "finish_reason",
    "openai_usage",
    "to_anthropic_request",
    "to_openai_response",
]
