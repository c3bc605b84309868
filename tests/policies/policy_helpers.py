"""Request builders shared by the policy tests."""

from policies import PolicyContext

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
