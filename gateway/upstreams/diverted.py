"""An event stream diverted: each read of its answer becomes a batch for the reader's function,
in the connection's read callback (`gateway.upstreams.base.Diverted`).

An event stream reads its answer one network read at a time; what a read gives is the same
whichever way it is read, so a stream describes a read once (`Step`) and both its
`__aiter__` and this class use that description: no event is read one way when relayed through
`send` and another when diverted.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.upstreams.base import OnBatch, OutEvent, UpstreamError
from gateway.upstreams.http1 import Http1Response

# One read of the answer: the batch it completes, whether the stream is over after it (known
# before the batch is read), and a failure to raise once the batch went out.
Step = Callable[[bytes], tuple[list[OutEvent], bool, UpstreamError | None]]


class DivertedReads:
    """`Diverted` over an answer on the gateway's HTTP/1.1 client. `over` says, after the
    reader has read a batch, whether the stream ended with it; `tail` is the last batch once the
    body has ended (None: nothing)."""

    def __init__(
        self,
        resp: Http1Response,
        on_batch: OnBatch,
        step: Step,
        over: Callable[[list[OutEvent]], bool],
        tail: Callable[[], list[OutEvent] | None],
    ) -> None:
        self._resp = resp
        self._on_batch = on_batch
        self._step = step
        self._over = over
        self._tail = tail
        resp.divert(self._read)

    def _read(self, chunk: bytes) -> bool:
        out, ended, failure = self._step(chunk)
        if out and (self._on_batch(out) or self._over(out)):
            return True
        if failure is not None:
            raise failure
        return ended

    async def ended(self) -> None:
        if await self._resp.diverted_end():
            return
        out = self._tail()
        if out is not None:
            self._on_batch(out)

    def pause(self) -> None:
        self._resp.pause()

    def resume(self) -> None:
        self._resp.resume()

    def stop(self) -> None:
        self._resp.undivert()
