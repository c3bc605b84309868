"""A streamed answer leaves nothing for the event loop to clean up. The relay stops reading at
`[DONE]` (the upstream body's terminator is still on its way), so every async generator on its
path must be closed by its reader: one left suspended is handed to the loop's finalizer, which
costs a wake-up and a task per generator per answer and runs its cleanup at no defined time."""

from __future__ import annotations

import asyncio
import gc
import os

import anthropic
import pytest

import gateway
from bench.mock_openai import MockUpstream, ThreadedServer
from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV, anthropic_route, openai_route

GATEWAY_DIR = os.path.dirname(os.path.abspath(gateway.__file__))
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture
def finalized(monkeypatch) -> list[str]:
    """The gateway's async generators that the event loop had to finalize. Patched before the
    gateway's loop starts: the loop installs its finalizer hook when it begins to run."""
    names: list[str] = []
    original = asyncio.BaseEventLoop._asyncgen_finalizer_hook

    def hook(loop, agen) -> None:
        if agen.ag_code.co_filename.startswith(GATEWAY_DIR):
            names.append(agen.__qualname__)
        original(loop, agen)

    monkeypatch.setattr(asyncio.BaseEventLoop, "_asyncgen_finalizer_hook", hook)
    return names


def _replicated_route(first: ThreadedServer, second: ThreadedServer) -> dict:
    return {
        "name": "fleet",
        "models": ["mock-*"],
        "kind": "openai",
        "api_key_env": UPSTREAM_KEY_ENV,
        "replicas": [
            {"name": "r0", "base_url": first.base_url},
            {"name": "r1", "base_url": second.base_url},
        ],
    }


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("kind", ["openai", "replicated", "anthropic"])
def test_an_answer_leaves_no_generator_for_the_loop(
    kind, stream, mock_upstream, make_gateway, finalized
) -> None:
    with ThreadedServer(MockUpstream()) as second:
        route = {
            "openai": lambda: openai_route(mock_upstream),
            "replicated": lambda: _replicated_route(mock_upstream, second),
            "anthropic": lambda: anthropic_route(mock_upstream),
        }[kind]()
        client = sdk_client(make_gateway([route]))
        model = "claude-x" if kind == "anthropic" else "mock-1"
        for _ in range(3):
            if stream:
                chunks = client.chat.completions.create(model=model, messages=MESSAGES, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                answer = client.chat.completions.create(model=model, messages=MESSAGES)
                text = answer.choices[0].message.content or ""
            assert text
        gc.collect()  # a generator kept alive by a reference cycle is finalized here, if at all
    assert finalized == []


def test_a_messages_stream_leaves_no_generator_for_the_loop(
    mock_upstream, make_gateway, finalized
) -> None:
    """The Messages door stops reading at `message_stop`, before the upstream body ends."""
    gw = make_gateway([anthropic_route(mock_upstream)])
    client = anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0, timeout=20)
    for _ in range(3):
        with client.messages.stream(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            assert "".join(stream.text_stream) == "Hello from Claude"
    gc.collect()
    assert finalized == []
