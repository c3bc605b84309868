"""A tenant's text cannot make the policies slow: every text rule is linear and bounded.

Each case is an adversarial text of about 200 KB aimed at one rule (the old trailing-space
regex took minutes on 200,000 spaces; the old passage regex rescanned the rest of the text
from every unclosed ``<passage``). The chain, with every text opt-in on, must transform it
well within a second or two, and give the same text that the old rules give on a small
version of it (checked against ``tests/policies/reference_text_rules.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from policies import DEFAULT_POLICIES, PolicyContext, build_chain
from policies.request import content_text
from policies.volatile import NOTE_MARKER
from tests.policies import reference_text_rules as ref

CTX = PolicyContext(endpoint="chat", route_kind="openai", model="gpt-4o", tenant="acme")
CHAIN = build_chain(
    DEFAULT_POLICIES,
    {
        "SLIM_MINIFY_JSON": "true",
        "SLIM_DEDUPE_PASSAGES": "true",
        "CANONICALIZE_VOLATILE": "true",
        "CANONICALIZE_SORT_PASSAGES": "true",
    },
)
BIG = 200_000  # characters of adversarial text per case
SMALL = 300
# CPU seconds of the test's own thread, which other processes' load does not inflate as it
# does wall time; generous still, the old rules took minutes.
LIMIT_S = 2.0


@dataclass(frozen=True)
class Case:
    name: str
    role: str  # "system" reaches the volatile and prefix-family rules too
    make: Callable[[int], str]  # the adversarial text, about n characters
    expected: Callable[[int], str]  # the message text after the chain
    legacy: Callable[[str], str] | None = None  # the old rule, to check `expected` on SMALL


def _passages_kept(text: str) -> str:
    return ref.dedupe_passages([ref.sort_passage_runs(text)])[0]


CASES = [
    Case(
        "spaces_then_a_word",
        "user",
        lambda n: "a" + " " * n + "b",
        lambda n: "a" + " " * n + "b",
        ref.slim_prose,
    ),
    Case(
        "spaces_then_a_line_break",
        "user",
        lambda n: "a" + " \t" * (n // 2) + "\nb",
        lambda n: "a\nb",
        ref.slim_prose,
    ),
    Case(
        "space_runs_on_every_line",
        "user",
        lambda n: "a" + "   \n" * (n // 4) + "b",
        lambda n: "a\n\n\nb",
        ref.slim_prose,
    ),
    Case(
        "many_short_space_runs",
        "user",
        lambda n: "a " * (n // 2) + "\n",
        lambda n: ("a " * (n // 2))[:-1] + "\n",
        ref.slim_prose,
    ),
    Case(
        "line_breaks", "user", lambda n: "a" + "\n" * n + "b", lambda n: "a\n\n\nb", ref.slim_prose
    ),
    Case(
        "crlf_line_breaks",
        "user",
        lambda n: "a" + "\r\n" * (n // 2) + "b",
        lambda n: "a\r\n\r\n\r\nb",
        ref.slim_prose,
    ),
    Case(
        "lone_carriage_returns",
        "user",
        lambda n: "a" + "\r\r\n" * (n // 3) + " b",
        lambda n: "a" + "\r\r\n" * (n // 3) + " b",
        ref.slim_prose,
    ),
    Case(
        "invisibles",
        "user",
        lambda n: "a" + " \u200b" * (n // 2) + "\nb",
        lambda n: "a\nb",
        ref.slim_prose,
    ),
    Case(
        "fence_lines",
        "user",
        lambda n: "```\n" * (n // 8 * 2) + "x  ",
        lambda n: "```\n" * (n // 8 * 2) + "x",
        None,
    ),
    Case(
        "backtick_run",
        "user",
        lambda n: "`" * n + "  \n\n\n\n\nx",
        lambda n: "`" * n + "  \n\n\n\n\nx",
        None,
    ),
    Case(
        "fence_with_a_huge_info_string",
        "user",
        lambda n: "```" + "a" * n + "  \n\n\n\n\n",
        lambda n: "```" + "a" * n + "  \n\n\n\n\n",
        None,
    ),
    Case(
        "unclosed_passages",
        "system",
        lambda n: "<passage>" * (n // 9),
        lambda n: "<passage>" * (n // 9),
        _passages_kept,
    ),
    Case(
        "passage_openings_without_a_bracket",
        "system",
        lambda n: "<passage " * (n // 9),
        lambda n: ("<passage " * (n // 9))[:-1],
        None,
    ),
    Case(
        "passages_closed_once_at_the_end",
        "system",
        lambda n: "<passage>x" * (n // 10) + "</passage>",
        lambda n: "<passage>x" * (n // 10) + "</passage>",
        _passages_kept,
    ),
    Case(
        "digits_and_spaces",
        "system",
        lambda n: "1 " * (n // 2) + "x",
        lambda n: "1 " * (n // 2) + "x",
        None,
    ),
    Case(
        "digits_and_dashes",
        "system",
        lambda n: "1-" * (n // 2) + "x",
        lambda n: "1-" * (n // 2) + "x",
        None,
    ),
    Case("one_long_hex_run", "system", lambda n: "a1" * (n // 2), lambda n: "[id_1]", None),
    Case(
        "dates_and_clocks",
        "system",
        lambda n: "2024-01-05 12:30:45 " * (n // 20) + "x",
        lambda n: "[time_1] " * (n // 20) + "x",
        None,
    ),
    Case(
        "a_long_json_string",
        "tool",
        lambda n: '["' + "a" * n + '" ,  1]',
        lambda n: '["' + "a" * n + '",1]',
        None,
    ),
    Case(
        "json_nested_past_the_parser_limit",
        "tool",
        lambda n: "[" * (n // 2) + "]" * (n // 2),
        lambda n: "[" * (n // 2) + "]" * (n // 2),
        None,
    ),
]


def _body(case: Case, text: str) -> dict:
    messages: list[dict] = []
    if case.role == "tool":
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages += [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": text},
        ]
    else:
        messages.append({"role": case.role, "content": text})
    messages.append({"role": "user", "content": "question"})
    return {"model": "gpt-4o", "messages": messages}


def _transformed_text(case: Case, text: str) -> tuple[str, float]:
    body = _body(case, text)
    start = time.thread_time()
    result = CHAIN.transform(body, CTX)
    elapsed = time.thread_time() - start
    index = 2 if case.role == "tool" else 0
    return content_text(result.body["messages"][index]["content"]), elapsed


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_an_adversarial_text_is_transformed_quickly_and_as_before(case: Case):
    small = case.make(SMALL)
    if case.legacy is not None:
        assert case.legacy(small) == case.expected(SMALL)
    assert _transformed_text(case, small)[0] == case.expected(SMALL)
    text, elapsed = _transformed_text(case, case.make(BIG))
    assert text == case.expected(BIG)
    assert elapsed < LIMIT_S, f"{case.name}: {elapsed:.2f} s of CPU"


def test_the_volatile_note_names_the_values_of_a_long_prompt():
    body = _body(Case("system", "system", str, str), "2024-01-05 12:30:45 " * (BIG // 20) + "x")
    note = CHAIN.transform(body, CTX).body["messages"][-1]["content"]
    assert note.startswith(NOTE_MARKER) and "[time_1] = 2024-01-05 12:30:45" in note


def test_a_million_spaces_are_counted_not_a_tokenizer_panic():
    """tiktoken's pre-tokenizer panics (a BaseException) on a run of about a million spaces."""
    text = " " * 1_100_000 + "x"
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": text}]}
    start = time.thread_time()
    result = CHAIN.transform(body, CTX).measure()
    elapsed = time.thread_time() - start
    assert 1_000 < result.prompt_tokens_before < 100_000
    assert result.prompt_tokens_after == result.prompt_tokens_before  # no line end: spaces kept
    assert elapsed < 3 * LIMIT_S, f"{elapsed:.2f} s of CPU"
