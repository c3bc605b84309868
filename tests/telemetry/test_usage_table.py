"""The usage table: each provider's cached-token field in OpenAI's, untrusted input throughout."""

import pytest

from gateway.telemetry.usage import (
    cached_prompt_tokens,
    chat_usage,
    chunk_usage,
    from_anthropic,
    with_chat_usage,
)
from gateway.translation.converse_to_chat import converse_usage as from_converse
from gateway.translation.gemini_to_chat import openai_usage as from_gemini


def test_openai_usage_is_returned_as_is():
    usage = {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1024}}
    assert chat_usage(usage) is usage
    chunk = {"choices": [], "usage": usage}
    assert with_chat_usage(chunk) is None
    assert with_chat_usage({"choices": [{"delta": {"content": "x"}}]}) is None
    assert with_chat_usage({"choices": [], "usage": None}) is None


def test_deepseek_and_moonshot_fields_fill_openai_s_and_stay():
    deepseek = {
        "prompt_tokens": 1100,
        "prompt_cache_hit_tokens": 1024,
        "prompt_cache_miss_tokens": 76,
    }
    filled = chat_usage(deepseek)
    assert filled["prompt_tokens_details"] == {"cached_tokens": 1024}
    assert filled["prompt_cache_hit_tokens"] == 1024 and filled["prompt_cache_miss_tokens"] == 76
    moonshot = {"prompt_tokens": 50, "cached_tokens": 32}
    assert chat_usage(moonshot)["prompt_tokens_details"] == {"cached_tokens": 32}
    assert cached_prompt_tokens(moonshot) == 32


def test_other_details_are_kept_and_the_larger_count_wins():
    usage = {
        "prompt_tokens": 2000,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 3},
        "prompt_cache_hit_tokens": 1536,
    }
    assert chat_usage(usage)["prompt_tokens_details"] == {"cached_tokens": 1536, "audio_tokens": 3}


@pytest.mark.parametrize("junk", ["1024", 10.5, -3, True, None, [1], {"n": 1}, 1 << 60])
def test_wrong_types_count_as_zero_and_never_raise(junk):
    usage = {"prompt_tokens": 100, "prompt_cache_hit_tokens": junk}
    result = chat_usage(usage)
    assert cached_prompt_tokens(result) == 0
    assert chat_usage({"prompt_tokens_details": "junk", "cached_tokens": 7}) == {
        "prompt_tokens_details": {"cached_tokens": 7},
        "cached_tokens": 7,
    }
    assert cached_prompt_tokens(junk) == 0
    assert chunk_usage({"choices": junk}) is None


def test_moonshot_choice_usage_is_lifted_to_the_chunk():
    chunk = {"choices": [{"index": 0, "finish_reason": "stop", "usage": {"cached_tokens": 9}}]}
    fixed = with_chat_usage(chunk)
    assert fixed["usage"]["prompt_tokens_details"] == {"cached_tokens": 9}
    assert fixed["choices"] == chunk["choices"]


def test_cached_count_is_clamped_to_the_prompt():
    assert cached_prompt_tokens({"prompt_tokens": 10, "prompt_cache_hit_tokens": 64}) == 10


def test_converters_of_non_chat_shapes():
    assert from_anthropic(
        {"input_tokens": 5, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 20}
    )["prompt_tokens_details"] == {"cached_tokens": 1000, "cache_write_tokens": 20}
    converse = from_converse(
        {
            "inputTokens": 7,
            "outputTokens": 3,
            "cacheReadInputTokens": 1024,
            "cacheWriteInputTokens": 0,
        }
    )
    assert converse["prompt_tokens"] == 1031 and cached_prompt_tokens(converse) == 1024
    gemini = from_gemini(
        {"promptTokenCount": 3000, "cachedContentTokenCount": 2048, "candidatesTokenCount": 4}
    )
    assert gemini["prompt_tokens"] == 3000 and cached_prompt_tokens(gemini) == 2048
    assert from_gemini("junk")["prompt_tokens"] == 0
    assert from_converse(None)["prompt_tokens_details"]["cached_tokens"] == 0
