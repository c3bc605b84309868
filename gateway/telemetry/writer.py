"""The background batch writer: a bounded buffer between the request path and the store.

`enqueue` is all the request path ever does: an O(1) append, or, when the buffer
is full, a counted drop. A background task takes up to `flush_batch` events at a
time from the front of the buffer, folds them into counters and writes them in
one round trip; only after the store confirms the write are they removed. So
while the store is down the events simply stay buffered (within the bound), and
the ones that arrive on a full buffer are exactly the ones dropped.

A batch is applied at most once. Once folded it is pinned, with a number of its own
(`writer_id`, `seq`), and retried unchanged until the store takes it; the store skips a
batch number it has already applied (see `redis_store`), so a write that reached the
store but whose answer was lost is not counted again. Only a transient failure is
retried; any other drops the batch, counted and logged, so a bad batch cannot stall
the writer or be re-sent forever.

Fingerprint blobs waiting for the store are bounded by count and by bytes, in all and
per tenant (`BLOBS_MAX`, `BLOBS_MAX_BYTES`, `BLOBS_TENANT_MAX_BYTES`): a tenant
controls their size (a 30k-message prompt makes a ~1 MB blob) and their family names.

The cache advisor's counter deltas wait in `put_advice` (merged per tenant, family and bucket,
at most `ADVICE_PENDING_MAX` of them) and go to the store after each batch; they are advisory,
so a retried write may count them twice.

While idle the writer pings the store every `HEALTH_PROBE_S` (every backoff step while
failing), so `failures` tells the truth about the store even when nothing is written; between
pings it sleeps until something is queued (then waits `flush_interval_s` to gather a batch), so
an idle gateway's loop is not woken ten times a second for nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from .aggregate import Aggregate, fold_event
from .event import RequestEvent
from .store import Store, blob_bytes

log = logging.getLogger("firsttoken.telemetry")

BLOBS_MAX = 1024  # distinct (tenant, family) fingerprint blobs waiting to be written
BLOBS_MAX_BYTES = 32 * 2**20  # their bytes (`store.blob_bytes`), all tenants together
BLOBS_TENANT_MAX_BYTES = 4 * 2**20  # ... and one tenant's share of that
ADVICE_PENDING_MAX = 4096  # (tenant, family, bucket) advisor counters waiting to be written
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 2.0
HEALTH_PROBE_S = 5.0  # an idle writer pings the store this often
LOST_LOG_EVERY_S = 60.0  # one log line per period for batches the store refuses for good


def _describe(exc: BaseException) -> str:
    """Type and message (redis-py's own repr shows only a category and the type)."""
    return f"{type(exc).__name__}: {str(exc)[:300]}"


@dataclass(slots=True)
class _Batch:
    seq: int
    count: int  # events taken from the front of the buffer
    malformed: int  # of those, events that could not be folded (dropped)
    aggregate: Aggregate


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
        self._blob_bytes = 0
        self._tenant_blob_bytes: dict[str, int] = {}
        self.blobs_dropped = 0  # blobs refused because the pending ones hit a bound
        self._advice: dict[tuple[str, str, int], dict[str, int]] = {}
        self.advice_dropped = 0  # advisor counter updates refused or lost
        self.dropped = (
            0  # events lost: buffer full, unwritable batch, or still buffered at shutdown
        )
        self.written = 0  # events the store confirmed
        self.lost_batches = 0  # batches dropped on an error that retrying cannot fix
        self._lost_logged_at = float("-inf")
        self.failures = 0  # consecutive failed writes or probes (0 while healthy)
        self.writer_id = uuid.uuid4().hex[:16]
        self._seq = itertools.count(1)
        self._pending: _Batch | None = None
        self._last_contact = float("-inf")  # monotonic time the store last answered
        self._wake = asyncio.Event()  # a batch is full: flush now
        self._work = asyncio.Event()  # something to write after an idle spell
        self._stop = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def buffered(self) -> int:
        return len(self._events)

    @property
    def blob_bytes(self) -> int:
        """Bytes of fingerprint blobs waiting to be written (bounded by `BLOBS_MAX_BYTES`)."""
        return self._blob_bytes

    def _drop(self, count: int) -> None:
        self.dropped += count
        self._on_drop(count)

    def enqueue(self, event: RequestEvent) -> bool:
        """Buffer one event for the store; False (and counted) if the buffer is full."""
        if len(self._events) >= self.buffer_max:
            self._drop(1)
            return False
        self._events.append(event)
        self._work.set()
        if len(self._events) >= self.flush_batch and not self.failures:
            self._wake.set()
        return True

    def put_blob(self, tenant: str, family: str, blob: bytes, ttl_s: int) -> bool:
        """Queue a blob (latest wins); O(1). False, and counted, if it would pass a bound; a
        refused blob also withdraws the older one queued for the same family."""
        key = (tenant, family)
        old = self._blobs.pop(key, None)
        if old is not None:
            self._forget_blob(tenant, family, old[0])
        size = blob_bytes(family, blob)
        tenant_bytes = self._tenant_blob_bytes.get(tenant, 0)
        if (
            len(self._blobs) >= BLOBS_MAX
            or self._blob_bytes + size > BLOBS_MAX_BYTES
            or tenant_bytes + size > BLOBS_TENANT_MAX_BYTES
        ):
            self.blobs_dropped += 1
            return False
        self._blobs[key] = (blob, ttl_s)
        self._work.set()
        self._blob_bytes += size
        self._tenant_blob_bytes[tenant] = tenant_bytes + size
        return True

    def _forget_blob(self, tenant: str, family: str, blob: bytes) -> None:
        size = blob_bytes(family, blob)
        self._blob_bytes -= size
        left = self._tenant_blob_bytes.get(tenant, 0) - size
        if left > 0:
            self._tenant_blob_bytes[tenant] = left
        else:
            self._tenant_blob_bytes.pop(tenant, None)

    def put_advice(self, tenant: str, family: str, bucket: int, fields: dict[str, int]) -> bool:
        """Add advisor counter deltas to the pending ones; O(fields). False, and counted, when
        `ADVICE_PENDING_MAX` other keys are already waiting."""
        key = (tenant, family, bucket)
        pending = self._advice.get(key)
        if pending is None:
            if len(self._advice) >= ADVICE_PENDING_MAX:
                self.advice_dropped += 1
                return False
            pending = self._advice[key] = {}
        for name, amount in fields.items():
            pending[name] = pending.get(name, 0) + amount
        self._work.set()
        return True

    async def _write_advice(self) -> None:
        """Hand the pending advisor counters to the store; on a transient failure they are
        merged back (within the bound) and the failure raised for the writer's backoff."""
        write = getattr(self.store, "write_advice", None)
        taken, self._advice = self._advice, {}
        if not taken or write is None:
            return
        try:
            await write(taken)
        except Exception as exc:
            if not self._is_transient(exc):
                self.advice_dropped += len(taken)
                log.error("telemetry: advisor counters dropped: %s", _describe(exc))
                return
            for (tenant, family, bucket), fields in taken.items():
                self.put_advice(tenant, family, bucket, fields)
            raise

    def pending_blob(self, tenant: str, family: str) -> bytes | None:
        """A blob not yet written, so a reader in this process sees its own latest write."""
        entry = self._blobs.get((tenant, family))
        return entry[0] if entry else None

    async def flush_once(self) -> int:
        """Write the oldest `flush_batch` events and pending blobs; raises if the store fails
        transiently (the same batch is then retried by the next call)."""
        async with self._flush_lock:  # a second flusher must not take the same events
            return await self._flush_locked()

    def _take(self) -> _Batch:
        taken = list(islice(self._events, self.flush_batch))
        aggregate: Aggregate = {}
        malformed = 0
        for event in taken:
            try:
                fold_event(aggregate, event)
            except Exception:  # noqa: BLE001  # one malformed event, whatever it holds, must not stall the batch
                malformed += 1
        if malformed:
            log.error("telemetry: %d malformed events dropped", malformed)
        return _Batch(next(self._seq), len(taken), malformed, aggregate)

    async def _flush_locked(self) -> int:
        if self._pending is None:
            self._pending = self._take()
        batch = self._pending
        blobs = dict(self._blobs)
        try:
            await self.store.write(batch.aggregate, blobs, batch=(self.writer_id, batch.seq))
        except Exception as exc:
            if self._is_transient(exc):
                raise
            self._note_lost_batch(batch, exc)
            self._finish(batch, blobs)
            self._drop(batch.count)
            return batch.count
        self._last_contact = time.monotonic()
        self._finish(batch, blobs)
        if batch.malformed:
            self._drop(batch.malformed)
        self.written += batch.count - batch.malformed
        await self._write_advice()
        return batch.count

    def _note_lost_batch(self, batch: _Batch, exc: BaseException) -> None:
        """Log a batch the store refused for good: the first, then one line per period."""
        self.lost_batches += 1
        now = time.monotonic()
        if now - self._lost_logged_at < LOST_LOG_EVERY_S:
            return
        self._lost_logged_at = now
        log.error(
            "telemetry: batch %d of %d events could not be written, dropped (%d batches lost "
            "so far): %s",
            batch.seq,
            batch.count,
            self.lost_batches,
            _describe(exc),
        )

    def _is_transient(self, exc: BaseException) -> bool:
        is_transient = getattr(self.store, "is_transient", None)
        if is_transient is None:
            return isinstance(exc, (OSError, asyncio.TimeoutError))
        return bool(is_transient(exc))

    def _finish(self, batch: _Batch, blobs: dict[tuple[str, str], tuple[bytes, int]]) -> None:
        self._pending = None
        for _ in range(batch.count):
            self._events.popleft()
        for key, entry in blobs.items():
            if self._blobs.get(key) is entry:  # not replaced by a newer put meanwhile
                del self._blobs[key]
                self._forget_blob(key[0], key[1], entry[0])

    async def drain(self) -> None:
        """Flush until the buffer is empty; raises on the first transiently failed write."""
        while self._events or self._blobs or self._advice:
            await self.flush_once()

    async def _drain_or_probe(self) -> None:
        """Drain; with nothing to write, ping the store if it failed or has been quiet long."""
        if self._events or self._blobs or self._advice:
            await self.drain()
            return
        ping = getattr(self.store, "ping", None)
        quiet = time.monotonic() - self._last_contact >= HEALTH_PROBE_S
        if ping is not None and (self.failures or quiet):
            await ping()
            self._last_contact = time.monotonic()

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
                if not self._has_work():
                    await self._sleep_unless_stopped(self._work, self._until_probe_s())
                    self._work.clear()
                if self._has_work():  # gather a batch
                    await self._sleep_unless_stopped(self._wake, self.flush_interval_s)
                self._wake.clear()
            if self._stop.is_set():
                break
            try:
                await self._drain_or_probe()
            except Exception as exc:  # noqa: BLE001  # no store failure may end the writer task
                if self.failures == 0:
                    log.warning("telemetry store unavailable, buffering events: %s", _describe(exc))
                self.failures += 1
            else:
                if self.failures:
                    log.warning("telemetry store back after %d failed attempts", self.failures)
                self.failures = 0
                backoff = BACKOFF_FIRST_S

    def _has_work(self) -> bool:
        return bool(self._events or self._blobs or self._advice)

    def _until_probe_s(self) -> float:
        """Seconds until an idle writer's next ping of the store is due (never less than a
        flush interval: a store that cannot be pinged must not make the writer spin)."""
        if getattr(self.store, "ping", None) is None:
            return HEALTH_PROBE_S
        due = self._last_contact + HEALTH_PROBE_S - time.monotonic()
        return min(HEALTH_PROBE_S, max(self.flush_interval_s, due))

    @staticmethod
    async def _sleep_unless_stopped(event: asyncio.Event, timeout_s: float) -> None:
        # A timeout scope, not `wait_for`: on Python 3.11 that wraps the wait in a task of its
        # own, two more steps and a task for every sleep of a writer that sleeps ten times a
        # second.
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Stop the task and flush what is buffered, giving up after `timeout_s`."""
        self._stop.set()
        self._wake.set()
        self._work.set()
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
        except Exception as exc:  # noqa: BLE001  # shutdown must finish; what is left is counted below
            if self._events:
                log.warning(
                    "telemetry: %d buffered events lost at shutdown: %s",
                    len(self._events),
                    _describe(exc),
                )
        if self._events:
            lost = len(self._events)
            self._events.clear()
            self._drop(lost)
        self._pending = None
        self._blobs.clear()
        self._advice.clear()
        self._blob_bytes = 0
        self._tenant_blob_bytes.clear()
