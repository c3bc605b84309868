"""What one request measured, turned into a telemetry event at its end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# A token count above this is not a count (and would overflow a Redis counter in time).
MAX_TOKEN_COUNT = 1 << 40


@dataclass(slots=True)
class RequestTiming:
    tenant: str
    model: str
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)
    wall_arrival: float = field(default_factory=time.time)
    route: str = "-"
    api: str = "chat"  # the client API served, one of gateway.telemetry.event.APIS
    status: str = "ok"
    fallback: bool = False
    hedged: bool = False  # set by the replica fleet when a second replica was asked
    upstream_sent: float | None = None
    upstream_first_content: float | None = None
    first_content_out: float | None = None
    last_content_out: float | None = None
    content_events: int = 0
    usage: dict | None = None
    prompt_tokens_saved: int = 0

    def content_arrived(self, arrived: float, written: float) -> None:
        """A batch with content came from upstream at `arrived` and reached the client's
        socket at `written`."""
        if self.upstream_first_content is None:
            self.upstream_first_content = arrived
            self.first_content_out = written
        self.last_content_out = written
        self.content_events += 1

    def to_event(self):
        from gateway.telemetry import RequestEvent

        end = time.perf_counter()
        usage = self.usage if isinstance(self.usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        if not isinstance(details, dict):
            details = {}
        output_tokens = token_count(usage.get("completion_tokens"))
        ttft = upstream_ttft = mean_itl = None
        if self.stream and self.first_content_out is not None:
            ttft = self.first_content_out - self.arrival
            if self.upstream_sent is not None and self.upstream_first_content is not None:
                upstream_ttft = self.upstream_first_content - self.upstream_sent
            gaps = max(output_tokens, self.content_events) - 1
            if gaps > 0 and self.last_content_out is not None:
                mean_itl = (self.last_content_out - self.first_content_out) / gaps
        return RequestEvent(
            tenant=self.tenant,
            route=self.route,
            model=self.model,
            stream=self.stream,
            status=self.status,
            ttft_s=ttft,
            upstream_ttft_s=upstream_ttft,
            total_s=end - self.arrival,
            output_tokens=output_tokens,
            mean_itl_s=mean_itl,
            prompt_tokens=token_count(usage.get("prompt_tokens")),
            cached_prompt_tokens=token_count(details.get("cached_tokens")),
            prompt_tokens_saved=self.prompt_tokens_saved,
            fallback=self.fallback,
            hedged=self.hedged,
            api=self.api,
            ts=self.wall_arrival,
        )


def token_count(value: Any) -> int:
    """A usage field from upstream, which is untrusted: anything but a non-negative integer
    (a string, a float, a negative or absurd number, nested junk) counts as 0, alone."""
    if type(value) is int and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return 0
