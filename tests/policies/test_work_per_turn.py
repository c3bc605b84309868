"""The work a request's report does over its prompt grows with what is new in it, not with the
conversation: a next turn tokenizes and chunk-hashes only its new messages, and a family's
history is decoded once per blob."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from policies import DEFAULT_POLICIES, build_chain, clear_caches, diagnostics, tokens
from policies.diagnostics import PrefixFingerprints
from policies.prefix_breaks import decode_history, encode_history, family_break
from tests.policies.policy_helpers import OPENAI, chat
from tests.support.compiled import patches_policies

SYSTEM = " ".join(f"Rule {i}: answer with care and cite the manual." for i in range(500))


def conversation(turns: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} " + "detail " * 60})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {turn} " + "since " * 90})
    return chat(*messages)


@patches_policies
def test_a_next_turn_counts_and_hashes_only_its_new_text(monkeypatch):
    encoded: list[int] = []
    hashed: list[int] = []
    real_encode, real_hash = tokens._encoded_length, diagnostics._chunk_hashes

    def encode(text: str) -> int:
        encoded.append(len(text))
        return real_encode(text)

    def chunk_hashes(text: str):
        hashed.append(len(text))
        return real_hash(text)

    monkeypatch.setattr(tokens, "_encoded_length", encode)
    monkeypatch.setattr(diagnostics, "_chunk_hashes", chunk_hashes)
    clear_caches()
    chain = build_chain(DEFAULT_POLICIES, {})
    history: list = []
    per_turn = []
    for turns in range(1, 9):
        encoded.clear()
        hashed.clear()
        body = orjson.loads(orjson.dumps(conversation(turns)))  # fresh objects, as parsed
        result = chain.transform(body, OPENAI).measure()
        found, recorded = family_break(decode_history(encode_history(history)), result.fingerprints)
        history.append(recorded)
        per_turn.append((sum(encoded), sum(hashed)))
        assert found is None or found.breaks == ()
    first_encoded, first_hashed = per_turn[0]
    assert first_encoded >= len(SYSTEM) and first_hashed >= len(SYSTEM)
    new_text = len(" answer 0 " + "since " * 90) + len("question 1 " + "detail " * 60)
    for encoded_chars, hashed_chars in per_turn[1:]:
        # The new assistant answer and question only (the system prompt and older turns are
        # known by their content), however long the conversation has grown.
        assert encoded_chars <= 2 * new_text, per_turn
        assert hashed_chars <= 2 * new_text, per_turn


@pytest.fixture
def decodes(monkeypatch) -> Callable[[], list[int]]:
    """Start counting fingerprint decodings (each one's size); call to start, read the list."""
    decoded: list[int] = []
    real = PrefixFingerprints._decode

    def counting(data: bytes) -> PrefixFingerprints:
        decoded.append(len(data))
        return real(data)

    def start() -> list[int]:
        monkeypatch.setattr(PrefixFingerprints, "_decode", staticmethod(counting))
        return decoded

    return start


@patches_policies
def test_a_history_blob_is_decoded_once(decodes):
    decoded = decodes()
    clear_caches()
    chain = build_chain(DEFAULT_POLICIES, {})
    prints = chain.apply(conversation(3), OPENAI).fingerprints
    _, recorded = family_break([], prints)
    blob = encode_history([recorded] * 4)
    clear_caches()  # as a blob another gateway wrote to the shared store
    for _ in range(5):
        assert len(decode_history(blob)) == 4
    assert len(decoded) == 1  # four equal entries, five reads: one decode


@patches_policies
def test_a_history_this_gateway_encoded_is_read_back_without_decoding(decodes):
    clear_caches()
    chain = build_chain(DEFAULT_POLICIES, {})
    history = []
    for turns in (2, 3, 4):
        prints = chain.apply(conversation(turns), OPENAI).fingerprints
        _, recorded = family_break(history, prints)
        history.append(recorded)
    blob = encode_history(history)
    decoded = decodes()
    read_back = decode_history(blob)
    assert decoded == []  # the family's next request pays no decoding
    clear_caches()
    assert read_back == decode_history(blob)  # and reads what decoding gives
    assert len(decoded) == 3


def test_a_long_text_counts_as_new_until_it_has_been_counted_once():
    clear_caches()
    chain = build_chain(DEFAULT_POLICIES, {})
    first = chain.transform(conversation(1), OPENAI)
    assert first.counts_new_text()  # the system prompt has never been counted
    first.measure()
    assert not first.counts_new_text()  # measured: nothing left to count
    again = chain.transform(conversation(2), OPENAI)
    assert not again.counts_new_text()  # the next turn's new messages are short
    short = chat({"role": "user", "content": "word " * 100})
    assert not tokens.has_uncounted_text(short)
    parts = chat({"role": "user", "content": [{"type": "text", "text": "fresh " * 2000}]})
    assert tokens.has_uncounted_text(parts)  # a text part counts as well as a string
    assert tokens.has_uncounted_text({"prompt": "legacy " * 2000})
