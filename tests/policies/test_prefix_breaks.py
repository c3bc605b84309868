"""What counts as a break of a family's shared prefix (``policies.prefix_breaks``)."""

from __future__ import annotations

from policies import build_chain
from policies.prefix_breaks import (
    HISTORY,
    RecordedRequest,
    decode_history,
    encode_history,
    family_break,
)
from tests.policies.policy_helpers import OPENAI, chat, tool

SYSTEM = "".join(f"Rule {index}: answer politely and cite sources. " for index in range(60))
CHAIN = build_chain(("slim", "canonicalize", "cache_hints"), {})


def prints(body):
    return CHAIN.apply(body, OPENAI).fingerprints


def request(*turns, system=SYSTEM, tools=None):
    return chat(
        {"role": "system", "content": system},
        *turns,
        tools=tools if tools is not None else [tool("a"), tool("b"), tool("c")],
    )


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def replay(*bodies):
    """Each body's verdict against the family's history, as the gateway records it."""
    history: list[RecordedRequest] = []
    verdicts = []
    for body in bodies:
        found, recorded = family_break(decode_history(encode_history(history)), prints(body))
        verdicts.append(found)
        history.append(recorded)
    return verdicts


def named(found):
    return None if found is None else [block.location for block in found.breaks]


def test_a_new_question_after_an_unchanged_prefix_is_not_a_break():
    first, second = replay(request(user("What is 2+2?")), request(user("Name a colour.")))
    assert first is None and named(second) == []
    assert second.stable_tokens > 0


def test_a_growing_conversation_is_not_a_break():
    turns = [user("one"), assistant("1"), user("two"), assistant("2"), user("three")]
    verdicts = replay(*(request(*turns[: 2 * n + 1]) for n in range(3)))
    assert [named(v) for v in verdicts] == [None, [], []]


def test_interleaved_sessions_of_one_family_are_not_breaks():
    sessions = [[user(f"session {s} opens")] for s in range(HISTORY)]
    bodies = []
    for turn in range(3):
        for s, turns in enumerate(sessions):
            bodies.append(request(*turns))
            turns += [assistant(f"answer {turn} to {s}"), user(f"follow-up {turn} of {s}")]
    verdicts = replay(*bodies)
    assert all(named(v) == [] for v in verdicts[1:]), [named(v) for v in verdicts]


def test_a_new_conversation_after_a_long_one_is_not_a_break():
    turns = [user("one"), assistant("1"), user("two"), assistant("2"), user("three")]
    bodies = [request(*turns[: 2 * n + 1]) for n in range(3)]
    *_, fresh = replay(*bodies, request(user("a different question")))
    assert named(fresh) == []


def test_a_changed_clock_in_the_system_prompt_is_a_break():
    at = SYSTEM.index("Rule 30")
    clock = SYSTEM[:at] + "Now: 10:00:00. " + SYSTEM[at:]
    moved = clock.replace("10:00:00", "10:05:00")
    _, found = replay(request(user("q"), system=clock), request(user("q2"), system=moved))
    [where] = named(found)
    assert where.startswith("messages[0]@char ") and int(where.split()[-1]) <= at
    assert found.breaks[0].kind == "system"


def test_every_changed_block_is_named_in_provider_order():
    at = SYSTEM.index("Rule 30")
    clock = SYSTEM[:at] + "Now: 10:00:00. " + SYSTEM[at:]
    moved = clock.replace("10:00:00", "10:05:00")
    tools = [tool("a"), tool("b"), tool("c")]
    before = request(user("q"), system=clock, tools=tools)
    after = request(user("q"), system=moved, tools=list(reversed(tools)))
    _, found = replay(before, after)
    locations = named(found)
    assert locations[0] == "tools(order)" and locations[1].startswith("messages[0]@char ")
    assert len(locations) == 2
    assert [block.kind_class for block in found.breaks] == ["tools(order)", "system"]
    assert found.header == ", ".join(locations)


def test_a_changed_earlier_turn_of_the_conversation_is_a_break():
    turns = [user("one"), assistant("1"), user("two"), assistant("2"), user("three")]
    edited = [user("one"), assistant("1 (edited)"), *turns[2:], assistant("3"), user("four")]
    bodies = [request(*turns[: 2 * n + 1]) for n in range(3)]
    *_, found = replay(*bodies, request(*edited))
    assert named(found) == ["messages[2]@char 0"]  # the answer two requests have repeated


def test_an_answer_only_its_own_request_held_is_not_yet_shared():
    turns = [user("one"), assistant("1"), user("two")]
    edited = [user("one"), assistant("1 (edited)"), user("two")]
    *_, found = replay(request(*turns[:1]), request(*turns), request(*edited))
    assert named(found) == []


def test_an_edited_first_turn_of_a_continued_conversation_is_a_break():
    turns = [user("one"), assistant("1"), user("two")]
    edited = [user("ONE"), *turns[1:], assistant("2"), user("three")]
    *_, found = replay(request(*turns[:1]), request(*turns), request(*edited))
    assert named(found) == ["messages[1]@char 0"]


def test_history_is_bounded_and_reads_an_older_single_fingerprint():
    bodies = [request(user(f"question {n}")) for n in range(HISTORY + 5)]
    history: list[RecordedRequest] = []
    for body in bodies:
        _, recorded = family_break(history, prints(body))
        history = decode_history(encode_history([*history, recorded]))
    assert len(history) == HISTORY
    old_blob = prints(bodies[0]).to_bytes()
    [entry] = decode_history(old_blob)
    assert entry.shared == 4  # three tools and the system prompt: the anchor
    assert decode_history(b"junk") == []


def test_a_request_that_stops_inside_the_shared_turns_is_not_a_break():
    turns = [user("one"), assistant("1"), user("two"), assistant("2"), user("three")]
    # The second request repeats the first's "two"; the third stops before it.
    *_, shorter = replay(request(*turns[:3]), request(*turns), request(*turns[:2]))
    assert named(shorter) == []


def test_a_decoded_history_is_the_callers_own_to_extend():
    # Histories are kept decoded by their bytes: what one request appends must not show up
    # in the next request's read of the same blob.
    blob = encode_history([RecordedRequest(prints(request(user("one"))), 4)])
    first = decode_history(blob)
    first.append(RecordedRequest(prints(request(user("two"))), 4))
    assert len(decode_history(blob)) == 1
    assert decode_history(bytearray(blob)) == decode_history(blob)
