import copy
import itertools
import json

from policies import build_chain
from policies.slim import minify_json_text, slim_text
from tests.policies.policy_helpers import OPENAI, chat, code_blocks, tool


def run(body, **options):
    return build_chain(("slim",), {key: str(value) for key, value in options.items()}).apply(
        body, OPENAI
    )


def test_trailing_whitespace_blank_runs_and_invisibles():
    text = "Hello   \nworld\t\n\n\n\n\nend\u200b \ufeffdone"
    assert slim_text(text) == "Hello\nworld\n\n\nend done"


def test_crlf_lines_keep_their_endings():
    assert slim_text("a  \r\nb\r\n\r\n\r\n\r\n\r\nc") == "a\r\nb\r\n\r\n\r\nc"


def test_code_blocks_with_trailing_spaces_are_untouched():
    code = "```diff\n-old line   \n+new line  \n\n\n\n\n```\n"
    text = "Intro   \n" + code + "after   \n~~~\nunclosed fence   \n\n\n\n\n"
    result = slim_text(text)
    assert code in result
    assert result.startswith("Intro\n")
    assert "after\n" in result
    assert result.endswith("~~~\nunclosed fence   \n\n\n\n\n")  # an unclosed fence runs to the end


def test_indentation_and_joiners_and_non_ascii_are_kept():
    text = (
        "    indented line\n\tTabbed\n"
        "family: \U0001f468\u200d\U0001f469\u200d\U0001f467 "
        "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 \u00e9t\u00e9  "
    )
    result = slim_text(text)
    assert result == text.rstrip(" ")
    assert "\u200d" in result and "\u200c" in result


def test_messages_dropped_and_collapsed_but_tool_calls_kept():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a":  1}  '},
    }
    body = chat(
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "  "},
        {"role": "user", "content": "repeat"},
        {"role": "user", "content": "repeat   "},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": ""},
        {"role": "assistant", "content": ""},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": ""},
                {"type": "image_url", "image_url": {"url": "x"}},
            ],
        },
    )
    original = copy.deepcopy(body)
    result = run(body)
    assert body == original  # input never mutated
    roles = [message["role"] for message in result.body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert result.body["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"a":  1}  '
    assert result.notes["slim"] == {"dropped_empty": 2, "collapsed_duplicates": 1}
    assert result.prompt_tokens_after < result.prompt_tokens_before


def test_minify_json_is_opt_in_and_exact():
    pretty = json.dumps(
        {"b": 1.10, "a": [1, 2, {"name": 'caf\\u00e9 "q"'}], "big": 123456789012345678901234567890},
        indent=2,
    )
    pretty = pretty.replace("1.1", "1.10")
    body = chat(
        {"role": "user", "content": "see"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{ }"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": pretty},
        {
            "role": "user",
            "content": (
                'Block:\n```json\n{\n  "x": [1, 2]\n}\n```\nand ```json\n{ not json }\n```\n'
            ),
        },
    )
    assert run(body).body["messages"][2]["content"] == pretty
    result = run(body, SLIM_MINIFY_JSON="true")
    minified = result.body["messages"][2]["content"]
    assert json.loads(minified) == json.loads(pretty)
    assert (
        "1.10" in minified
        and "123456789012345678901234567890" in minified
        and "\\u00e9" in minified
    )
    assert " " not in minified.replace('caf\\\\u00e9 \\"q\\"', "")
    user_text = result.body["messages"][3]["content"]
    assert '```json\n{"x":[1,2]}\n```' in user_text
    assert "```json\n{ not json }\n```" in user_text  # invalid JSON left as is
    assert minify_json_text("{broken: json}") == "{broken: json}"


def test_dedupe_passages_keeps_the_first():
    passage = '<passage id="7">Refunds take 5 days.</passage>'
    body = chat(
        {"role": "system", "content": f"Memory:\n{passage}"},
        {"role": "user", "content": f"Context {passage} and <passage>other</passage>"},
    )
    result = run(body, SLIM_DEDUPE_PASSAGES="true")
    assert result.body["messages"][0]["content"] == f"Memory:\n{passage}"
    assert result.body["messages"][1]["content"] == (
        'Context <passage id="7">(same as above)</passage> and <passage>other</passage>'
    )
    assert run(result.body, SLIM_DEDUPE_PASSAGES="true").body == result.body


def _agent_history(rounds):
    messages = [{"role": "system", "content": "You are an agent."}]
    for turn in range(rounds):
        messages.append({"role": "user", "content": f"question {turn} " + "word " * 199 + "word"})
        call_id = f"call_{turn}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "search", "arguments": "{}"},
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call_id, "content": "result " * 149 + "result"}
        )
        messages.append({"role": "assistant", "content": f"answer {turn} " + "text " * 99 + "text"})
    return messages


def _calls_answered(messages):
    pending = set()
    for message in messages:
        for call in message.get("tool_calls") or ():
            pending.add(call["id"])
        if message["role"] == "tool":
            assert message["tool_call_id"] in pending, "tool result without its call"
            pending.discard(message["tool_call_id"])
    return not pending


def test_trim_to_budget_keeps_system_newest_and_pairs():
    body = chat(*_agent_history(12), tools=[tool("search")])
    full = run(body)
    budget = full.prompt_tokens_after // 3
    result = run(body, SLIM_MAX_PROMPT_TOKENS=budget)
    messages = result.body["messages"]
    assert result.prompt_tokens_after <= budget
    assert messages[0]["role"] == "system"
    assert messages[1]["role"] == "user"
    assert messages[-1] == body["messages"][-1]
    assert _calls_answered(messages)
    assert result.notes["slim"]["trimmed_messages"] % 4 == 0  # whole turns only
    assert run(result.body, SLIM_MAX_PROMPT_TOKENS=budget).body == result.body


def test_trim_at_the_budget_edge_drops_tool_rounds_whole():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "do the task"}]
    for index in range(6):
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"a{index}",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    },
                    {
                        "id": f"b{index}",
                        "type": "function",
                        "function": {"name": "g", "arguments": "{}"},
                    },
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"a{index}", "content": "x " * 99 + "x"})
        messages.append({"role": "tool", "tool_call_id": f"b{index}", "content": "y " * 99 + "y"})
    body = chat(*messages)
    total = run(body).prompt_tokens_after
    for budget in range(total - 400, total, 37):
        result = run(body, SLIM_MAX_PROMPT_TOKENS=budget)
        kept = result.body["messages"]
        assert kept[:2] == messages[:2]
        assert kept[-3:] == messages[-3:]
        assert _calls_answered(kept)
        assert result.prompt_tokens_after <= budget


def test_trim_cut_is_stable_while_the_conversation_grows():
    history = _agent_history(16)
    budget = 4000
    cuts = []
    for end in range(40, len(history) + 1, 4):
        result = run(chat(*history[:end]), SLIM_MAX_PROMPT_TOKENS=budget)
        cuts.append(result.body["messages"][1]["content"])
    changes = sum(1 for a, b in itertools.pairwise(cuts) if a != b)
    assert changes < len(cuts) - 1  # the first kept turn does not move on every turn


def test_completions_prompt_is_slimmed():
    body = {"model": "m", "prompt": "hello   \n\n\n\n\nworld"}
    assert run(body).body["prompt"] == "hello\n\n\nworld"
    body = {"model": "m", "prompt": [1, 2, 3]}
    assert run(body).body["prompt"] == [1, 2, 3]


def test_code_blocks_survive_the_whole_default_chain():
    text = "Fix this:\n```python\ndef f():  \n    return 1   \n```\n"
    body = chat({"role": "user", "content": text})
    result = build_chain(("slim", "canonicalize", "cache_hints"), {}).apply(body, OPENAI)
    assert code_blocks(result.body["messages"][0]["content"]) == code_blocks(text)
