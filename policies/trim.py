"""Trim a conversation's history to a prompt-token budget (slim opt-in).

What is dropped, oldest first: whole earlier turns (a turn starts at a user message), then the
older tool rounds of the newest turn (an assistant message with tool calls together with its
tool results, so a call is never separated from its results). System messages, the
volatile-values note, the newest turn's user message and its newest round are always kept.

Trimming moves the start of the conversation, which invalidates provider caches. To keep that
rare, the amount to drop is rounded up to a multiple of a quarter of the budget: the cut stays
at the same message for several turns while the conversation grows back toward the budget.
Trimming is idempotent because the result is always within the budget (or cannot shrink).
"""

from __future__ import annotations

from typing import Any

from policies.request import SYSTEM_ROLES, role_of
from policies.tokens import TOKENS_FOR_REPLY, count_message
from policies.volatile import is_volatile_note

_HYSTERESIS_STEPS = 4


def _units(messages: list[Any]) -> list[list[int]]:
    """Indices of droppable units, oldest first (see module docstring)."""
    turns: list[list[int]] = []
    for index, message in enumerate(messages):
        role = role_of(message)
        if role in SYSTEM_ROLES or is_volatile_note(message):
            continue
        if role == "user" or not turns:
            turns.append([index])
        else:
            turns[-1].append(index)
    if not turns:
        return []
    units = turns[:-1]
    last = turns[-1]
    rounds: list[list[int]] = []
    head = 1 if role_of(messages[last[0]]) == "user" else 0
    for index in last[head:]:
        if role_of(messages[index]) == "tool" and rounds:
            rounds[-1].append(index)
        else:
            rounds.append([index])
    units.extend(rounds[:-1])
    return units


def trim_history(messages: list[Any], fixed_tokens: int, budget: int) -> set[int]:
    """Indices of the messages to drop; ``fixed_tokens`` covers tools and other non-messages."""
    # The volatile-values note is left out of the count: it is added after trimming, so counting
    # it on a second pass would trim more than the first one did.
    counts = [0 if is_volatile_note(message) else count_message(message) for message in messages]
    total = fixed_tokens + TOKENS_FOR_REPLY + sum(counts)
    excess = total - budget
    if excess <= 0:
        return set()
    step = max(budget // _HYSTERESIS_STEPS, 1)
    to_drop = -(-excess // step) * step
    dropped: set[int] = set()
    dropped_tokens = 0
    for unit in _units(messages):
        if dropped_tokens >= to_drop:
            break
        dropped.update(unit)
        dropped_tokens += sum(counts[index] for index in unit)
    return dropped
