"""Simulated prefix-caching replicas and a multi-tenant chat workload, in virtual time.

`SimReplica` behaves like one vLLM/SGLang replica as far as routing can tell: a prefix cache of
fixed token capacity (chained hashes of 16-token blocks, least recently used out, the tails of
old prompts first), a fixed number of concurrent slots with a FIFO queue in front, and

    TTFT = wait for a slot + prefill_fixed + prefill_per_token * uncached prompt tokens

after which the request holds its slot while it decodes (decode_per_token * output tokens).
`slow_factor` multiplies both costs: a replica that slowed down (thermal throttling, a noisy
neighbour, a bad node). The replica knows nothing of the gateway's index: its own blocks, its
own hash, 16 tokens = 64 characters of the hex text the workload is made of (4 characters a
token).

`Workload` makes tenants (a system prompt and tools each, popularity skewed), sessions arriving
as a Poisson process, each a few turns apart by an exponential think time; every turn's prompt
is the tenant's prefix plus the whole conversation so far (an OpenAI chat body, made into text
by the gateway's own `prompt_text`). The text of every turn is fixed by the seed, whatever the
routing, so every mode sees the same requests; only their timing follows each mode's answers.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

from gateway.upstreams.replicas import prompt_text

CHARS_PER_TOKEN = 4
ENGINE_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class EngineCosts:
    slots: int = 8
    cache_tokens: int = 160_000  # prefix-cache capacity (KV blocks free for reuse)
    prefill_fixed_s: float = 0.020
    prefill_per_token_s: float = 0.000_15  # ~6.7k uncached tokens/s for one slot
    decode_per_token_s: float = 0.012


def engine_blocks(text: str) -> list[bytes]:
    """The replica's own view of a prompt: chained hashes of 16-token blocks."""
    step = ENGINE_BLOCK_TOKENS * CHARS_PER_TOKEN
    h = b"engine"
    out = []
    for start in range(0, len(text) - step + 1, step):
        h = blake2b(h + text[start : start + step].encode(), digest_size=12).digest()
        out.append(h)
    return out


@dataclass
class Request:
    session: Session
    turn: int
    text_tokens: int
    output_tokens: int
    gateway_blocks: list[bytes]
    engine_blocks: list[bytes]
    arrived: float = 0.0
    started: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    cached_tokens: int = 0
    replica: str = ""
    handle: Any = None  # what the router needs back when the request ends


class SimReplica:
    def __init__(self, name: str, costs: EngineCosts, clock: EventLoop) -> None:
        self.name = name
        self.costs = costs
        self.clock = clock
        self.slow_factor = 1.0
        self.busy = 0
        self.queue: deque[Request] = deque()
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.capacity_blocks = costs.cache_tokens // ENGINE_BLOCK_TOKENS
        self.busy_seconds = 0.0
        self.on_done: Callable[[Request], None] = lambda req: None

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def submit(self, req: Request) -> None:
        req.replica = self.name
        if self.busy < self.costs.slots:
            self._start(req)
        else:
            self.queue.append(req)

    def _start(self, req: Request) -> None:
        now = self.clock.now
        self.busy += 1
        req.started = now
        cached_blocks = self._lookup_and_insert(req.engine_blocks)
        req.cached_tokens = min(cached_blocks * ENGINE_BLOCK_TOKENS, req.text_tokens)
        uncached = req.text_tokens - req.cached_tokens
        c, f = self.costs, self.slow_factor
        prefill = f * (c.prefill_fixed_s + c.prefill_per_token_s * uncached)
        decode = f * c.decode_per_token_s * req.output_tokens
        req.first_token = now + prefill
        self.busy_seconds += prefill + decode
        self.clock.at(now + prefill + decode, self._finish, req)

    def _finish(self, req: Request) -> None:
        req.finished = self.clock.now
        self.busy -= 1
        if self.queue:
            self._start(self.queue.popleft())
        self.on_done(req)

    def _lookup_and_insert(self, blocks: list[bytes]) -> int:
        cache = self.cache
        hit = 0
        for b in blocks:
            if b not in cache:
                break
            hit += 1
        for b in reversed(blocks):
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > self.capacity_blocks:
            cache.popitem(last=False)
        return hit


class EventLoop:
    """Virtual time: callbacks in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    def run(self, until: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            fn(*args)
        self.now = until


@dataclass(frozen=True)
class WorkloadShape:
    tenants: int = 100
    tenant_zipf: float = 0.6  # popularity of tenant k ~ 1 / (k+1)**zipf
    system_tokens: tuple[int, int] = (1_500, 5_000)
    tools_tokens: tuple[int, int] = (0, 1_500)
    turns: tuple[int, int] = (2, 10)
    user_tokens: tuple[int, int] = (50, 600)
    output_tokens: tuple[int, int] = (40, 250)
    think_mean_s: float = 4.0


@dataclass
class Session:
    id: int
    tenant: int
    users: list[str]
    replies: list[str]
    output_tokens: list[int]
    thinks: list[float]
    requests: list[Request | None] = field(default_factory=list)


class Workload:
    """Tenants and sessions, fixed by the seed; a turn's request is built once and reused by
    every mode (the hashes are the costly part of the simulation)."""

    def __init__(self, shape: WorkloadShape, seed: int) -> None:
        self.shape = shape
        self.seed = seed
        rng = random.Random(seed)
        self.tenant_prefix: list[tuple[list[dict[str, Any]], str]] = []
        for t in range(shape.tenants):
            tools_chars = rng.randint(*shape.tools_tokens) * CHARS_PER_TOKEN
            tools: list[dict[str, Any]] = []
            while tools_chars > 0:
                desc = _hex(rng, min(tools_chars, 800))
                tools_chars -= len(desc) + 60
                tools.append(
                    {
                        "type": "function",
                        "function": {
                            "name": f"tool_{t}_{len(tools)}",
                            "description": desc,
                            "parameters": {"type": "object", "properties": {}},
                        },
                    }
                )
            system = _hex(rng, rng.randint(*shape.system_tokens) * CHARS_PER_TOKEN)
            self.tenant_prefix.append((tools, system))
        self.prefix_tokens = sum(
            len(prompt_text({"tools": tools, "messages": [{"role": "system", "content": system}]}))
            // CHARS_PER_TOKEN
            for tools, system in self.tenant_prefix
        )
        weights = [1.0 / (k + 1) ** shape.tenant_zipf for k in range(shape.tenants)]
        self.tenant_weights = weights
        self._sessions: dict[int, Session] = {}

    def session(self, sid: int) -> Session:
        """Session `sid`: its tenant and every turn's text, from its own seed."""
        found = self._sessions.get(sid)
        if found is not None:
            return found
        shape = self.shape
        rng = random.Random(f"{self.seed}/{sid}")
        tenant = rng.choices(range(shape.tenants), self.tenant_weights)[0]
        n = rng.randint(*shape.turns)
        outs = [rng.randint(*shape.output_tokens) for _ in range(n)]
        s = Session(
            id=sid,
            tenant=tenant,
            users=[_hex(rng, rng.randint(*shape.user_tokens) * CHARS_PER_TOKEN) for _ in range(n)],
            replies=[_hex(rng, k * CHARS_PER_TOKEN) for k in outs],
            output_tokens=outs,
            thinks=[rng.expovariate(1.0 / shape.think_mean_s) for _ in range(n)],
            requests=[None] * n,
        )
        self._sessions[sid] = s
        return s

    def body(self, s: Session, turn: int) -> dict[str, Any]:
        tools, system = self.tenant_prefix[s.tenant]
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for k in range(turn):
            messages.append({"role": "user", "content": s.users[k]})
            messages.append({"role": "assistant", "content": s.replies[k]})
        messages.append({"role": "user", "content": s.users[turn]})
        body: dict[str, Any] = {"model": "m", "messages": messages}
        if tools:
            body["tools"] = tools
        return body

    def request(
        self, s: Session, turn: int, gateway_blocks: Callable[[str, str], list[bytes]]
    ) -> Request:
        """A fresh request for this turn (hashes computed on first use, then shared)."""
        proto = s.requests[turn]
        if proto is None:
            text = prompt_text(self.body(s, turn))
            proto = Request(
                session=s,
                turn=turn,
                text_tokens=len(text) // CHARS_PER_TOKEN,
                output_tokens=s.output_tokens[turn],
                gateway_blocks=gateway_blocks(text, f"tenant-{s.tenant}"),
                engine_blocks=engine_blocks(text),
            )
            s.requests[turn] = proto
        return Request(
            session=s,
            turn=turn,
            text_tokens=proto.text_tokens,
            output_tokens=proto.output_tokens,
            gateway_blocks=proto.gateway_blocks,
            engine_blocks=proto.engine_blocks,
        )


def _hex(rng: random.Random, chars: int) -> str:
    return rng.randbytes((chars + 1) // 2).hex()[:chars]
