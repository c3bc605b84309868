"""What an inference server says of its own load, read from its Prometheus `/metrics`.

The gateway counts its own in-flight requests per replica, but only the server knows how many
wait in its queue (other gateways, other clients) and how full its KV cache is. vLLM and SGLang
both export these; the balancer adds them to its load term when a route names its server
(`load_metrics: "vllm" | "sglang"`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# server kind: (waiting requests, KV cache usage 0..1); the first name found wins
METRICS = {
    "vllm": (
        ("vllm:num_requests_waiting",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": (("sglang:num_queue_reqs",), ("sglang:token_usage",)),
}
MAX_METRICS_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ServerLoad:
    queue: int | None
    kv_usage: float | None


def parse_server_load(text: str, kind: str) -> ServerLoad:
    """The queue length (summed over the server's models and ranks) and the highest KV cache
    usage in `text`; None for what is absent or not a sane number (the text is untrusted)."""
    queue_names, usage_names = METRICS[kind]
    sums: dict[str, float] = {}
    peaks: dict[str, float] = {}
    # a server's /metrics is mostly histograms the balancer does not read: only the lines of
    # the samples it reads go to the parser (a vLLM page is hundreds of lines, read every
    # `load_interval_s` from every replica, on the serving loop)
    starts = tuple(name + end for name in (*queue_names, *usage_names) for end in ("{", " "))
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(starts))
    try:
        for family in text_string_to_metric_families(wanted):
            for sample in family.samples:
                value = sample.value
                if not math.isfinite(value) or value < 0:
                    continue
                if sample.name in queue_names:
                    sums[sample.name] = sums.get(sample.name, 0.0) + value
                elif sample.name in usage_names:
                    peaks[sample.name] = max(peaks.get(sample.name, 0.0), value)
    except (ValueError, TypeError, IndexError):
        return ServerLoad(None, None)
    queue = next((sums[n] for n in queue_names if n in sums), None)
    usage = next((peaks[n] for n in usage_names if n in peaks), None)
    return ServerLoad(
        None if queue is None else min(int(queue), 1_000_000),
        None if usage is None else min(usage, 1.0),
    )


class ReadPace:
    """Which ticks of a pool's load loop read the servers' `/metrics`: every tick while the
    gateway sends the pool requests; while it sends none, every 2nd, 4th, ... up to every
    `max_every`-th. An idle pool needs no fresh queue length (nothing of its own is waiting
    on it), and the reads were most of an idle gateway's CPU (four replicas every 0.5 s: 3-4 ms
    a second, against 0.9 without them); the first tick after a request is sent reads again,
    so a reading is at most one interval staler than before once traffic is back."""

    def __init__(self, max_every: int = 16) -> None:
        if max_every < 1:
            raise ValueError("max_every must be at least 1")
        self.max_every = max_every
        self.every = 1
        self._waited = 0

    def due(self, active: bool) -> bool:
        """Whether this tick reads; `active`: a request was sent since the last read, or one
        is still in flight."""
        if active:
            self.every, self._waited = 1, 0
            return True
        self._waited += 1
        if self._waited < self.every:
            return False
        self._waited = 0
        self.every = min(2 * self.every, self.max_every)
        return True
