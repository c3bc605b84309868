"""OpenAI chat completions -> Anthropic's Messages API and back: the one import for the
`anthropic` upstream kind.

Requests going up live in `chat_to_anthropic` (structured output, as a forced tool, in
`anthropic_structured`), everything coming back (whole responses, stream
events, error bodies) in `anthropic_to_chat`. All of it is pure.
"""

from gateway.translation.anthropic_structured import AnswerTool, answer_tool
from gateway.translation.anthropic_to_chat import (
    AnthropicStreamError,
    AnthropicStreamTranslator,
    error_to_openai,
    finish_reason,
    openai_usage,
    to_openai_response,
)
from gateway.translation.chat_to_anthropic import (
    ANTHROPIC_NATIVE_FIELDS,
    DEFAULT_MAX_TOKENS,
    DROPPED_FIELDS,
    TranslationError,
    to_anthropic_request,
)

__all__ = [
    "ANTHROPIC_NATIVE_FIELDS",
    "DEFAULT_MAX_TOKENS",
    "DROPPED_FIELDS",
    "AnswerTool",
    "AnthropicStreamError",
    "AnthropicStreamTranslator",
    "TranslationError",
    "answer_tool",
    "error_to_openai",
    "finish_reason",
    "openai_usage",
    "to_anthropic_request",
    "to_openai_response",
]
