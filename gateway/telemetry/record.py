"""The one record of a request: what it measured on the way, recorded once at its end.

Every door and route kind (plain, replicated, pd; chat, completions, Responses, Messages,
native or translated) fills a `RequestRecord` and ends it through `finish`, so TTFT, usage and
the status class are measured one way and reach telemetry exactly once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.telemetry.event import RequestEvent
from gateway.telemetry.usage import cached_prompt_tokens, token_count

if TYPE_CHECKING:
    from gateway.telemetry.telemetry import Telemetry

log = logging.getLogger("firsttoken.telemetry")


def status_class(status: int) -> str:
    """The one classification of how a request ended, from the HTTP status its client got (or
    would have got): 499 the client left, 504 the gateway's own timeout (an upstream's 504
    reaches the client as a 502), other 4xx but 429 the client's error, the rest upstream's."""
    if 200 <= status < 300:
        return "ok"
    if status == 499:
        return "client_gone"
    if status == 504:
        return "timeout"
    if 400 <= status < 500 and status != 429:
        return "client_error"
    return "upstream_error"


@dataclass(slots=True, eq=False)
class RequestRecord:
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
    request_id: str = ""
    telemetry: Telemetry | None = field(default=None, repr=False)
    finished: bool = False

    def content_arrived(self, arrived: float, written: float) -> None:
        """A batch with content came from upstream at `arrived` and reached the client's
        socket at `written`."""
        if self.upstream_first_content is None:
            self.upstream_first_content = arrived
            self.first_content_out = written
        self.last_content_out = written
        self.content_events += 1

    def ended_with(self, status: int) -> None:
        """The client got (or would have got) `status`; a failure already noted stands."""
        if self.status == "ok":
            self.status = status_class(status)

    def finish(self) -> None:
        """Record the request, once. Telemetry never fails a request: whatever goes wrong in it
        is logged (by type: the data came from an upstream), the response stands."""
        if self.finished:
            return
        self.finished = True
        if self.telemetry is None:
            return
        try:
            self.telemetry.record(self.to_event())
        except Exception as exc:  # noqa: BLE001  # telemetry must never fail the response
            log.warning(
                "telemetry event of request %s lost: %s", self.request_id, type(exc).__name__
            )

    def _prompt_taken(self) -> bool:
        """Whether the upstream took the (slimmed) prompt: the request ended ok, or its client
        left once the answer had begun. What a failed request's policies saved saved nothing."""
        if self.status == "ok":
            return True
        return self.status == "client_gone" and self.upstream_first_content is not None

    def to_event(self) -> RequestEvent:
        end = time.perf_counter()
        usage = self.usage if isinstance(self.usage, dict) else {}
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
            cached_prompt_tokens=cached_prompt_tokens(usage),
            prompt_tokens_saved=self.prompt_tokens_saved if self._prompt_taken() else 0,
            fallback=self.fallback,
            hedged=self.hedged,
            api=self.api,
            ts=self.wall_arrival,
        )
