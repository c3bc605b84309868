"""The one builder of OpenAI response dicts: chat and completions, streamed and whole."""

from __future__ import annotations

from engine_backend.engine_thread import RequestOutput
from engine_backend.openai_response import CHAT, COMPLETIONS, ENDPOINTS, ResponseBuilder


def output(reason: str | None = "length") -> RequestOutput:
    return RequestOutput(
        request_id="r",
        text="",
        token_ids=[],
        finished=True,
        finish_reason=reason,
        num_prompt_tokens=10,
        num_cached_tokens=8,
        num_output_tokens=3,
    )


def test_a_chat_stream_shares_one_head_and_ends_with_usage() -> None:
    response = ResponseBuilder(CHAT, "m", 10, include_usage=True)
    chunks = [
        *response.opening_chunks(),
        response.text_chunk("hi"),
        response.finish_chunk(output()),
        response.usage_chunk(output()),
    ]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "hi"},
        {},
    ]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:3])
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_a_completions_stream_has_no_role_chunk_and_no_usage_unless_asked() -> None:
    response = ResponseBuilder(COMPLETIONS, "m", 10)
    assert response.opening_chunks() == []
    chunk = response.text_chunk("hi")
    assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]
    assert "usage" not in chunk
    assert response.finish_chunk(output("stop"))["choices"][0]["text"] == ""


def test_whole_responses_put_the_text_where_each_endpoint_does() -> None:
    chat = ResponseBuilder(ENDPOINTS["chat"], "m", 10).whole("hello", output("abort"))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hello",
        "refusal": None,
    }
    assert chat["choices"][0]["finish_reason"] == "stop"  # "abort" has no OpenAI counterpart
    text = ResponseBuilder(ENDPOINTS["completions"], "m", 10).whole("hello", None)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hello"
    assert text["usage"]["completion_tokens"] == 0
