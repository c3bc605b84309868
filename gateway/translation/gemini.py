"""OpenAI chat completions -> Gemini `generateContent` and back: the one import for the `gemini`
upstream kind and for `vertex`'s Google models.

Requests going up live in `chat_to_gemini`, everything coming back (whole responses, stream
chunks, error bodies) in `gemini_to_chat`. All of it is pure.
"""

from gateway.translation.chat_to_anthropic import TranslationError
from gateway.translation.chat_to_gemini import (
    DROPPED_FIELDS,
    GEMINI_NATIVE_FIELDS,
    SIGNATURE_SEPARATOR,
    to_gemini_request,
)
from gateway.translation.gemini_to_chat import (
    GeminiStreamTranslator,
    error_to_openai,
    finish_reason,
    google_error,
    openai_usage,
    to_openai_response,
)

__all__ = [
    "DROPPED_FIELDS",
    "GEMINI_NATIVE_FIELDS",
    "SIGNATURE_SEPARATOR",
    "GeminiStreamTranslator",
    "TranslationError",
    "error_to_openai",
    "finish_reason",
    "google_error",
    "openai_usage",
    "to_gemini_request",
    "to_openai_response",
]
