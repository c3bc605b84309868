"""What the pd tests send through the gateway and read back."""

from __future__ import annotations


def chat(
    client, content: str = "hello", stream: bool = True, system: str | None = None, **extra
) -> str:
    """One chat through the OpenAI SDK, streamed or not; the answer's text."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": content})
    if not stream:
        answer = client.chat.completions.create(model="m", messages=messages, **extra)
        return answer.choices[0].message.content
    chunks = client.chat.completions.create(model="m", messages=messages, stream=True, **extra)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def router(gw):
    return gw.runtime.upstreams["pd"]
