"""The engine loop in its own thread, and one async stream of outputs per request.

LLMEngine is single-threaded and its `step()` blocks for a whole forward pass, so it
runs in a dedicated thread while asyncio serves HTTP. Requests and aborts reach the
thread as typed messages through a lock-free inbox; outputs come back through each
request's asyncio queue via `loop.call_soon_threadsafe`. Detokenization and stop
strings are handled in the thread too, so a matched stop string aborts the sequence
before the next step spends time on it. A failure that belongs to one request (its
sampling, its detokenization) ends that request's stream with RequestFailedError and
nothing else; only a failed step as a whole ends every stream (EngineClosedError).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from engine_backend.llm_engine import LLMEngine, StepOutput
from engine_backend.pd.kv_blocks import KVBlocks
from engine_backend.sampling import SamplingParams
from engine_backend.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long the idle thread sleeps before looking at its stop flag again.
IDLE_WAIT_S = 0.05


class EngineClosedError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step) before the request finished."""


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine (its sampling or detokenization); the
    engine and every other request go on. Retrying would only replay the failure."""


@dataclass
class RequestOutput:
    """What one engine step produced for one request: new tokens and the text they complete."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # Prefill role: blocks pinned for a decode server when the request finished.
    held_block_ids: list[int] | None = None


# What a request's queue carries: its outputs, then possibly the error that ended it.
OutputQueue = asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Tracked:
    """Engine-thread state of one live request."""

    loop: asyncio.AbstractEventLoop
    queue: OutputQueue
    detokenizer: IncrementalDetokenizer | None
    stop: list[str]
    text: str = ""
    sent: int = 0
    num_output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Inbox message: queue a request; `accepted` is settled once the engine took it or
    refused it (the refusal, a ValueError, is the future's exception)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    tracked: _Tracked
    accepted: asyncio.Future[int]  # its result: prompt tokens whose KV was imported
    kv_hold_id: str | None = None
    kv_import: KVBlocks | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Inbox message: drop a request and free its blocks before the next step."""

    request_id: str


@dataclass(frozen=True, slots=True)
class CallInEngine(Generic[T]):
    """Inbox message: run `fn(llm)` on the engine thread between two steps (the one safe
    place to read or write the KV cache from outside a step); `done` gets its result."""

    fn: Callable[[LLMEngine], T]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[T]


InboxMessage = AddRequest | AbortRequest | CallInEngine[Any]


def _stop_hold_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still grow into a stop string (not sent yet)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Earliest index at or after `start` where any stop string begins, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


class RequestStream:
    """Async iterator over one request's outputs. Closing it early aborts the request,
    which frees its KV blocks in the engine at once."""

    def __init__(self, thread: EngineThread, request_id: str, queue: OutputQueue) -> None:
        self._thread = thread
        self.request_id = request_id
        self._queue = queue
        self._done = False
        self.num_imported_tokens = 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """Stop the request now (synchronous, safe inside `finally` during cancellation)."""
        if not self._done:
            self._done = True
            self._thread.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


class EngineThread:
    """Runs an LLMEngine in a background thread and serves per-request async streams."""

    def __init__(self, llm: LLMEngine, tokenizer: Tokenizer | None = None) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self._inbox: collections.deque[InboxMessage] = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._start_lock = threading.Lock()

    @property
    def is_running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def start(self) -> None:
        """Start the engine thread; calling it again is harmless."""
        with self._start_lock:
            if self.is_running:
                return
            self._stopping.clear()
            self._worker = threading.Thread(target=self._run, name="firsttoken-engine", daemon=True)
            self._worker.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; pending requests get EngineClosedError."""
        self._stopping.set()
        self._wakeup.set()
        if self._worker is not None:
            self._worker.join(timeout)
            if self._worker.is_alive():
                logger.warning("engine thread did not stop within %.0f s", timeout)
            self._worker = None

    async def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stop: list[str] | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        kv_hold_id: str | None = None,
        kv_import: KVBlocks | None = None,
    ) -> RequestStream:
        """Hand a request to the engine and wait until it accepts it.

        Waiting for acceptance costs no first-token time (a token needs a step after
        acceptance anyway) and lets the engine's validation errors (ValueError) reach
        the caller before any output has been sent. `kv_hold_id` and `kv_import` are
        LLMEngine.add_request's (prefill/decode separation); the stream's
        `num_imported_tokens` says how much of `kv_import` was used.
        """
        if not self.is_running:
            raise EngineClosedError("engine is not running; call start() first")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}"
        queue: OutputQueue = asyncio.Queue()
        accepted: asyncio.Future[int] = loop.create_future()
        detokenizer = (
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
            if self.tokenizer is not None
            else None
        )
        tracked = _Tracked(
            loop=loop, queue=queue, detokenizer=detokenizer, stop=[s for s in (stop or []) if s]
        )
        self._post(
            AddRequest(
                request_id,
                list(prompt_token_ids),
                params,
                cache_salt,
                tracked,
                accepted,
                kv_hold_id,
                kv_import,
            )
        )
        try:
            imported = await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        stream = RequestStream(self, request_id, queue)
        stream.num_imported_tokens = imported
        return stream

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(llm)` on the engine thread between steps and return its result (its
        exception is raised here). Raises EngineClosedError when the thread is not running."""
        if not self.is_running:
            raise EngineClosedError("engine is not running; call start() first")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._post(CallInEngine(fn, loop, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to drop a request; its blocks are freed before the next step."""
        self._post(AbortRequest(request_id))

    # -- engine thread -------------------------------------------------------------------

    def _post(self, message: InboxMessage) -> None:
        self._inbox.append(message)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wakeup.clear()
            self._drain_inbox()
            self.llm.expire_kv_holds()
            if not self.llm.has_unfinished():
                self._wakeup.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = self.llm.step()
            except Exception as exc:  # a failed step must not hang every client (logged)
                logger.exception("engine step failed")
                self._fail_all(EngineClosedError(f"engine step failed: {exc}"))
                continue
            for output in outputs:
                tracked = self._tracked.get(output.request_id)
                try:
                    self._deliver(output)
                except Exception:  # detokenizing or stop strings broke this request only
                    logger.exception("delivering output of %s failed", output.request_id)
                    self._fail_one(output.request_id, tracked, "detokenization failed")
        self._drain_inbox()
        self._fail_all(EngineClosedError("engine shut down"))
        self.llm.kv_holds.release_all()

    def _drain_inbox(self) -> None:
        while self._inbox:
            message = self._inbox.popleft()
            if isinstance(message, AddRequest):
                self._accept(message)
            elif isinstance(message, CallInEngine):
                self._call(message)
            else:
                self._abort_now(message.request_id)

    def _call(self, message: CallInEngine[Any]) -> None:
        error: BaseException | None = None
        result: Any = None
        try:
            result = message.fn(self.llm)
        except Exception as exc:  # noqa: BLE001 -- the caller gets it; the thread goes on
            error = exc
        self._call_in_loop(message.loop, _settle, message.done, error, result)

    def _accept(self, add: AddRequest) -> None:
        error: BaseException | None = None
        imported = 0
        try:
            imported = self.llm.add_request(
                add.request_id,
                add.prompt_token_ids,
                add.params,
                cache_salt=add.cache_salt,
                kv_hold_id=add.kv_hold_id,
                kv_import=add.kv_import,
            )
            self._tracked[add.request_id] = add.tracked
        except Exception as exc:  # noqa: BLE001 -- a refusal goes to its caller; the thread goes on
            error = exc
        self._call_in_loop(add.tracked.loop, _settle, add.accepted, error, imported)

    def _abort_now(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is None:
            return
        try:
            self.llm.abort_request(request_id)
        except Exception:  # the thread must go on serving the others (logged)
            logger.exception("abort of %s failed", request_id)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, tracked in list(self._tracked.items()):
            self._abort_now(request_id)
            self._call_in_loop(tracked.loop, tracked.queue.put_nowait, error)

    def _fail_one(self, request_id: str, tracked: _Tracked | None, message: str) -> None:
        """End one request with RequestFailedError in its own stream; free it in the engine."""
        if tracked is None:
            return
        self._abort_now(request_id)
        self._call_in_loop(tracked.loop, tracked.queue.put_nowait, RequestFailedError(message))

    def _deliver(self, out: StepOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:  # aborted by us; the engine may still report it once
            return
        if out.error is not None:  # the engine already dropped it
            self._tracked.pop(out.request_id, None)
            self._call_in_loop(
                tracked.loop, tracked.queue.put_nowait, RequestFailedError(out.error)
            )
            return
        tracked.num_output_tokens += len(out.new_token_ids)
        finished, reason = out.finished, out.finish_reason
        if tracked.detokenizer is not None:
            tracked.text += tracked.detokenizer.add(out.new_token_ids)
            if finished:
                tracked.text += tracked.detokenizer.flush()
        end = len(tracked.text)
        if tracked.stop:
            longest = max(len(s) for s in tracked.stop)
            hit = _find_stop(tracked.text, tracked.stop, max(0, tracked.sent - longest + 1))
            if hit is not None:
                end = hit
                if not finished:
                    self._abort_now(out.request_id)
                finished, reason = True, "stop"
            elif not finished:
                end -= _stop_hold_back(tracked.text, tracked.stop)
        text = tracked.text[tracked.sent : end]
        tracked.sent = max(tracked.sent, end)
        if finished:
            self._tracked.pop(out.request_id, None)
        result = RequestOutput(
            request_id=out.request_id,
            text=text,
            token_ids=list(out.new_token_ids),
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=tracked.num_output_tokens,
            held_block_ids=out.held_block_ids,
        )
        self._call_in_loop(tracked.loop, tracked.queue.put_nowait, result)

    @staticmethod
    def _call_in_loop(
        loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: Any
    ) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the client's event loop is gone; nobody is listening
            pass


def _settle(future: asyncio.Future[Any], error: BaseException | None, result: Any = None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
