"""Folding events into additive counters, the unit every store writes and merges.

An event becomes a handful of field increments on the bucket of its tenant, route,
client API and wall-clock minute: counts, sums and histogram bucket counts. Everything is a
sum, so a batch of events can be pre-aggregated in memory before it is written,
and buckets from several processes or minutes merge by adding field by field.

Field names: `n` requests, `stream` streamed ones, `fb` fallbacks, `err` errors, `hedged`
hedged requests (a second replica asked for the first token),
`s:<status>` per status; histograms `t:<i>` TTFT, `u:<i>` upstream TTFT,
`g:<i>` gateway share (TTFT minus upstream TTFT), `c:<i>` time to the complete
response of non-stream requests; sums `t_sum`, `u_sum`, `g_sum`, `c_sum`,
`total_sum`, `itl_sum` (seconds, floats) and `itl_n`, `prompt`, `cached`,
`saved`, `out` (integers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from .event import APIS, STATUSES, RequestEvent
from .histogram import MAX_INDEX, bucket_index

Fields = dict[str, float]
BucketKey = tuple[str, str, str, int]  # tenant, route, api, minute (unix seconds // 60)
Aggregate = dict[BucketKey, Fields]

FLOAT_FIELDS = frozenset({"t_sum", "u_sum", "g_sum", "c_sum", "total_sum", "itl_sum"})
_KNOWN_STATUSES = frozenset(STATUSES)
_KNOWN_APIS = frozenset(APIS)
_MAX_COUNT = 2**53  # larger "token counts" are garbage, and would overflow HINCRBY sums


def minute_of(ts: float) -> int:
    return int(ts // 60)


def _seconds(value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"non-finite duration {value!r}")
    return max(0.0, value)


def _count(value: int) -> int:
    value = int(value)
    if not 0 <= value < _MAX_COUNT:
        raise ValueError(f"count out of range: {value!r}")
    return value


def _sample(series: str, value_s: float) -> list[tuple[str, float]]:
    value_s = _seconds(value_s)
    return [(f"{series}:{bucket_index(value_s)}", 1), (f"{series}_sum", value_s)]


def checked_api(api: str) -> str:
    """`api` if it is one of `APIS`; raises ValueError otherwise (the gateway set it, so an
    unknown name is a bug to surface, not a value to count)."""
    if api not in _KNOWN_APIS:
        raise ValueError(f"unknown api {str(api)[:40]!r}, expected one of {APIS}")
    return api


def event_increments(event: RequestEvent) -> list[tuple[str, float]]:
    """The field increments of one event; raises on a malformed event, changing nothing."""
    checked_api(event.api)
    status = event.status if event.status in _KNOWN_STATUSES else "other"
    out: list[tuple[str, float]] = [
        ("n", 1),
        (f"s:{status}", 1),
        ("total_sum", _seconds(event.total_s)),
    ]
    if status != "ok":
        out.append(("err", 1))
    if event.stream:
        out.append(("stream", 1))
    if event.fallback:
        out.append(("fb", 1))
    if event.hedged:
        out.append(("hedged", 1))
    if event.stream and event.ttft_s is not None:
        out += _sample("t", event.ttft_s)
        if event.upstream_ttft_s is not None:
            out += _sample("g", event.ttft_s - event.upstream_ttft_s)
    if not event.stream and status == "ok":
        out += _sample("c", event.total_s)
    if event.upstream_ttft_s is not None:
        out += _sample("u", event.upstream_ttft_s)
    if event.mean_itl_s is not None:
        out += [("itl_sum", _seconds(event.mean_itl_s)), ("itl_n", 1)]
    for name, amount in (
        ("prompt", event.prompt_tokens),
        ("cached", event.cached_prompt_tokens),
        ("saved", event.prompt_tokens_saved),
        ("out", event.output_tokens),
    ):
        if amount:
            out.append((name, _count(amount)))
    return out


def utf8_text(name: str) -> str:
    """The name as valid UTF-8 text (a lone surrogate would make every later write fail)."""
    if name.isascii():
        return name
    return name.encode("utf-8", "replace").decode("utf-8")


def fold_event(aggregate: Aggregate, event: RequestEvent) -> None:
    """Add one event's increments to its bucket in `aggregate`; a malformed event adds nothing."""
    increments = event_increments(event)
    key = (
        utf8_text(str(event.tenant)),
        utf8_text(str(event.route)),
        event.api,
        minute_of(float(event.ts)),
    )
    fields = aggregate.get(key)
    if fields is None:
        fields = aggregate[key] = {}
    for name, amount in increments:
        fields[name] = fields.get(name, 0) + amount


def merge_fields(into: Fields, other: Mapping[str, float]) -> None:
    """Add every field of `other` into `into`."""
    for name, amount in other.items():
        into[name] = into.get(name, 0) + amount


def histogram_counts(fields: Mapping[str, float], series: str) -> dict[int, int]:
    """The bucket counts of one histogram series (`t`, `u`, `g` or `c`) in merged fields."""
    prefix = series + ":"
    counts: dict[int, int] = {}
    for name, amount in fields.items():
        if name.startswith(prefix):
            counts[int(name[len(prefix) :])] = int(amount)
    return counts


def parse_field_value(name: str, raw: bytes | str) -> float:
    """Decode a stored field value: floats for the `*_sum` fields, integers otherwise."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return float(text) if name in FLOAT_FIELDS else int(text)


_HISTOGRAM_FIELD = re.compile(r"[tugc]:(.*)", re.S)
_KNOWN_FIELDS = frozenset(
    {
        "n",
        "stream",
        "fb",
        "err",
        "hedged",
        "itl_n",
        "prompt",
        "cached",
        "saved",
        "out",
        *FLOAT_FIELDS,
    }
)


def parse_stored_fields(raw: Mapping[Any, Any]) -> Fields:
    """A stored bucket's counters, checked: a bucket is read from a shared store, where anyone
    with access could have written into it. Fields of names this version does not know are
    left out (a newer gateway may add some); a histogram index out of range or a value that is
    not a number raises ValueError, and the caller leaves the whole bucket out."""
    fields: Fields = {}
    for raw_name, raw_value in raw.items():
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        histogram = _HISTOGRAM_FIELD.fullmatch(name)
        if histogram is not None:
            index = histogram.group(1)
            if not (index.isascii() and index.isdigit() and int(index) <= MAX_INDEX):
                raise ValueError(f"histogram field {name[:40]!r} out of range")
        elif name not in _KNOWN_FIELDS and not name.startswith("s:"):
            continue
        value = parse_field_value(name, raw_value)
        if not math.isfinite(value):
            raise ValueError(f"field {name[:40]!r} is not finite")
        fields[name] = value
    return fields
