"""The one record the request path hands to telemetry per request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STATUSES = ("ok", "client_error", "upstream_error", "timeout", "client_gone")
# The client API a request came in through. The gateway sets it from its own endpoint, never
# from client input, so a name outside this list is a bug: the event is refused (logged and
# counted as malformed), never folded into a fifth bucket.
APIS = ("chat", "completions", "responses", "messages")


@dataclass(slots=True)
class RequestEvent:
    """What one request cost, measured by the gateway.

    Durations are in seconds. `ttft_s` is set for streams only: from the request's
    arrival to the first content-bearing byte written to the client. A non-stream
    request leaves it None and its `total_s` goes into the separate "complete"
    series, so TTFT percentiles never mix in whole-response times.
    """

    tenant: str
    route: str
    model: str
    stream: bool
    status: str  # one of STATUSES
    ttft_s: float | None
    upstream_ttft_s: float | None  # upstream request sent -> first content event
    total_s: float  # arrival -> end
    output_tokens: int = 0
    mean_itl_s: float | None = None  # mean gap between output tokens
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prompt_tokens_saved: int = 0
    fallback: bool = False
    api: str = "chat"  # one of APIS
    hedged: bool = False  # a second replica was asked for the first token
    ts: float = field(default_factory=time.time)  # wall-clock arrival, picks the minute bucket
