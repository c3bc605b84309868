"""A family's history blob: the last few fingerprints per variant, bounded in bytes."""

from __future__ import annotations

from gateway.advisor import (
    OBSERVED,
    CacheRules,
    accounting,
    decode_history,
    encode_history,
    evaluate,
)
from policies.diagnostics import PrefixFingerprints


def _prints(turn: int) -> PrefixFingerprints:
    messages = [{"role": "system", "content": "You are terse. " * 50}]
    for n in range(turn + 1):
        messages.append({"role": "user", "content": f"question {n} " + "detail " * 40})
    return PrefixFingerprints.from_body({"model": "m", "messages": messages})


def test_the_history_keeps_the_last_entries_per_variant():
    blob = None
    for turn in range(accounting.HISTORY + 2):
        current = _prints(turn)
        _, blob = evaluate(decode_history(blob), {OBSERVED: current}, CacheRules("openai"))
    kept = decode_history(blob)[OBSERVED]
    assert len(kept) == accounting.HISTORY
    assert [p.to_bytes() for p in kept] == [
        _prints(turn).to_bytes() for turn in range(2, accounting.HISTORY + 2)
    ]


def test_a_history_over_its_byte_bound_drops_its_oldest_entries(monkeypatch):
    one = len(encode_history({OBSERVED: [_prints(3)]}))
    monkeypatch.setattr(accounting, "MAX_HISTORY_BYTES", 2 * one + 1)
    blob = None
    for turn in range(accounting.HISTORY):
        current = {OBSERVED: _prints(turn)}
        fields, blob = evaluate(decode_history(blob), current, CacheRules("moonshot"))
    assert len(blob) <= 2 * one + 1
    kept = decode_history(blob)[OBSERVED]
    assert 1 <= len(kept) < accounting.HISTORY
    assert kept[-1].to_bytes() == _prints(accounting.HISTORY - 1).to_bytes()
    # the last request was still compared with the entries kept: its prefix up to the new
    # question is a hit (moonshot's rules count the whole stable prefix)
    assert 0 < fields[f"cached:{OBSERVED}"] < fields[f"prompt:{OBSERVED}"]
