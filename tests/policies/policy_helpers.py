"""Request builders and inspectors shared by the policy tests."""

from policies import PolicyContext
from policies.fences import split_fences

OPENAI = PolicyContext(endpoint="chat", route_kind="openai", model="gpt-4.1", tenant="acme")
ANTHROPIC = PolicyContext(
    endpoint="chat", route_kind="anthropic", model="claude-sonnet-4", tenant="acme"
)
LOCAL = PolicyContext(endpoint="chat", route_kind="local", model="tiny", tenant="acme")


def tool(name, properties=None, description="does a thing"):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties or {"q": {"type": "string"}},
                "required": list(properties or {"q": 0}),
            },
        },
    }


def chat(*messages, **extra):
    return {"model": "gpt-4.1", "messages": list(messages), **extra}


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of ``text`` (fences included), in order."""
    return [segment.text for segment in split_fences(text) if segment.is_code]
