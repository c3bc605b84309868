"""The background batch writer: a bounded buffer between the request path and the store.

`enqueue` is all the request path ever does: an O(1) append, or, when the buffer
is full, a counted drop. A background task takes up to `flush_batch` events at a
time from the front of the buffer, folds them into counters and writes them in
one round trip; only after the store confirms the write are they removed. So
while the store is down the events simply stay buffered (within the bound), and
the ones that arrive on a full buffer are exactly the ones dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from itertools import islice
from typing import Callable

from .aggregate import Aggregate, fold_event
from .event import RequestEvent
from .store import Store

log = logging.getLogger("firsttoken.telemetry")

BLOBS_MAX = 1024  # distinct (tenant, family) fingerprint blobs waiting to be written
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 2.0


class BatchWriter:
    def __init__(
        self,
        store: Store,
        *,
        buffer_max: int,
        flush_interval_s: float,
        flush_batch: int,
        on_drop: Callable[[int], None] = lambda n: None,
    ) -> None:
        if buffer_max < 1 or flush_batch < 1 or flush_interval_s <= 0:
            raise ValueError("buffer_max and flush_batch must be >= 1, flush_interval_s > 0")
        self.store = store
        self.buffer_max = buffer_max
        self.flush_interval_s = flush_interval_s
        self.flush_batch = flush_batch
        self._on_drop = on_drop
        self._events: deque[RequestEvent] = deque()
        self._blobs: dict[tuple[str, str], tuple[bytes, int]] = {}
        self.dropped = (
            0  # events lost: buffer full, unwritable batch, or still buffered at shutdown
        )
        self.written = 0  # events the store confirmed
        self.failures = 0  # consecutive failed writes (0 while healthy)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def buffered(self) -> int:
        return len(self._events)

    def _drop(self, count: int) -> None:
        self.dropped += count
        self._on_drop(count)

    def enqueue(self, event: RequestEvent) -> bool:
        """Buffer one event for the store; False (and counted) if the buffer is full."""
        if len(self._events) >= self.buffer_max:
            self._drop(1)
            return False
        self._events.append(event)
        if len(self._events) >= self.flush_batch and not self.failures:
            self._wake.set()
        return True

    def put_blob(self, tenant: str, family: str, blob: bytes, ttl_s: int) -> None:
        key = (tenant, family)
        if key in self._blobs or len(self._blobs) < BLOBS_MAX:
            self._blobs[key] = (blob, ttl_s)

    def pending_blob(self, tenant: str, family: str) -> bytes | None:
        """A blob not yet written, so a reader in this process sees its own latest write."""
        entry = self._blobs.get((tenant, family))
        return entry[0] if entry else None

    async def flush_once(self) -> int:
        """Write the oldest `flush_batch` events and pending blobs; raises if the store fails."""
        async with self._flush_lock:  # a second flusher must not take the same events
            return await self._flush_locked()

    async def _flush_locked(self) -> int:
        taken = list(islice(self._events, self.flush_batch))
        blobs = dict(self._blobs)
        aggregate: Aggregate = {}
        malformed = 0
        for event in taken:
            try:
                fold_event(aggregate, event)
            except Exception:
                malformed += 1
        if malformed:
            log.error("telemetry: %d malformed events dropped", malformed)
        try:
            await self.store.write(aggregate, blobs)
        except Exception as exc:
            if self._store.is_transient(exc):
                raise
            log.error(
                "telemetry batch of %d events could not be written, dropped: %r", len(taken), exc
            )
            self._discard(len(taken), blobs)
            self._drop(len(taken))
            return len(taken)
        self._discard(len(taken), blobs)
        if malformed:
            self._drop(malformed)
        self.written += len(taken) - malformed
        return len(taken)

    def _discard(self, count: int, blobs: dict[tuple[str, str], tuple[bytes, int]]) -> None:
        for _ in range(count):
            self._events.popleft()
        for key, entry in blobs.items():
            if self._blobs.get(key) is entry:  # not replaced by a newer put meanwhile
                del self._blobs[key]

    async def drain(self) -> None:
        """Flush until the buffer is empty; raises on the first failed write."""
        while self._events or self._blobs:
            await self.flush_once()

    def start(self) -> None:
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="telemetry-writer"
            )

    async def _run(self) -> None:
        backoff = BACKOFF_FIRST_S
        while not self._stop.is_set():
            if self.failures:
                await self._sleep_unless_stopped(self._stop, backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            else:
                await self._sleep_unless_stopped(self._wake, self.flush_interval_s)
                self._wake.clear()
            try:
                await self.drain()
            except Exception as exc:
                if self.failures == 0:
                    log.warning("telemetry store unavailable, buffering events: %r", exc)
                self.failures += 1
            else:
                if self.failures:
                    log.warning("telemetry store back after %d failed writes", self.failures)
                self.failures = 0
                backoff = BACKOFF_FIRST_S

    @staticmethod
    async def _sleep_unless_stopped(event: asyncio.Event, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Stop the task and flush what is buffered, giving up after `timeout_s`."""
        self._stop.set()
        self._wake.set()
        if self._task is not None:
            task, self._task = self._task, None
            try:
                await asyncio.wait_for(task, timeout_s / 2)
            except (TimeoutError, asyncio.CancelledError):
                pass
            except Exception:  # the loop itself never raises; belt and braces for shutdown
                log.exception("telemetry writer failed")
        try:
            await asyncio.wait_for(self.drain(), timeout_s / 2)
        except Exception as exc:
            if self._events:
                log.warning(
                    "telemetry: %d buffered events lost at shutdown: %r", len(self._events), exc
                )
        if self._events:
            lost = len(self._events)
            self._events.clear()
            self._drop(lost)
        self._blobs.clear()
