"""What one request measured, turned into a telemetry event at its end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestTiming:
    tenant: str
    model: str
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)
    wall_arrival: float = field(default_factory=time.time)
    route: str = "-"
    status: str = "ok"
    fallback: bool = False
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
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        output_tokens = int(usage.get("completion_tokens") or 0)
        ttft = upstream_ttft = mean_itl = None
        if self.stream and self.first_content_out is not None:
            ttft = self.first_content_out - self.arrival
            if self.upstream_sent is not None and self.upstream_first_content is not None:
                upstream_ttft = self.upstream_first_content - self.upstream_sent
            gaps = max(output_tokens, self.content_events) - 1
            if gaps > 0 and self.last_content_out is not None:
                mean_itl = (self.last_content_out - self.first_content_out) / gaps
        return RequestEvent(
            tenant=self.tenant, route=self.route, model=self.model, stream=self.stream,
            status=self.status, ttft_s=ttft, upstream_ttft_s=upstream_ttft,
            total_s=end - self.arrival, output_tokens=output_tokens, mean_itl_s=mean_itl,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_prompt_tokens=int(details.get("cached_tokens") or 0),
            prompt_tokens_saved=self.prompt_tokens_saved, fallback=self.fallback,
            ts=self.wall_arrival,
        )
