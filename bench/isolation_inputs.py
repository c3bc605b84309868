"""What the attacker of `bench/isolation.py` sends: the heaviest inputs the gateway's limits
allow, and a few just over them, as raw HTTP requests on raw sockets (a client library would
not send an over-limit head), with the statuses a correct gateway answers.

Kept apart from the runner (processes, victim load, report) because it changes whenever the
gateway gains or moves a limit, and the sizing is the subtle part: every input is sized from
`gateway.config.settings.Settings` (the defaults, or FIRSTTOKEN_MAX_* and
FIRSTTOKEN_POLICY_THREAD_MIN_BYTES from the environment; `limit_env()` passes them on so the
gateway and the bench agree). The gateway counts the `{` and `[` bytes of a body before parsing
it (FIRSTTOKEN_MAX_JSON_CONTAINERS, strings included), so the heaviest allowed body has as many
objects and arrays as that cap allows, structure first, and fills the rest of max_body_bytes
with strings (free of `{` and `[`, so they spend no containers):

    biggest   just under max_body_bytes: a few long messages of varied text; and the same
              bytes with tool schemas holding containers just under the cap ("wide")
    messages  max_messages short messages per body; and max_messages messages with content
              parts up to the container cap and text up to the body limit ("full")
    deep      nesting one level under max_json_depth in content parts and tool schemas, small,
              and with containers just under the cap and text up to the body limit; over it:
              max_json_depth + 1 deep (small and full) and containers just over the cap
              (expect 400)
    headers   head just under max_header_bytes with max_headers - 1 fields, one huge field,
              a request line just under max_request_line_bytes; and over each (expect 431/414)
    metrics   the longest-window reads a tenant may make (TTFT figures, series, cache advice,
              31 days asked), in a loop on at least four connections, with a small chat of its
              own now and then so that its figures have routes to read (expect 200, or 429 once
              its reads queue past the gateway's budget)
    mixed     all of the above but metrics in rotation

Every request carries a unique nonce (model name, message text), so no cache helps.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson

PHASES = ("biggest", "messages", "deep", "headers", "mixed", "metrics")
METRICS_CONNECTIONS = 4  # "four longest-window reads in a loop"
LONGEST_WINDOW_S = 31 * 86400
ATTACKER_KEY = "sk-isolation-attacker"
NONCE = b"~nonce~~~~~~~~"  # replaced per request by a same-width counter
BODY_SLACK = 4096  # bodies end this close to max_body_bytes (what `fill` can reach)
NO_BRACKETS = str.maketrans("{[", "()")
REQUEST_TIMEOUT_S = 30.0  # one exchange
GRACE_S = 2.0  # requests in flight at the deadline may finish
MAX_REQUESTS_PER_CONNECTION = 100_000
MAX_RESPONSE_BYTES = 4 * 1024 * 1024


# -- limits -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    body_bytes: int
    json_depth: int
    json_containers: int
    messages: int
    header_bytes: int
    headers: int
    request_line_bytes: int
    model_chars: int

    @classmethod
    def from_settings(cls) -> Limits:
        from gateway.config.settings import load_settings

        s = load_settings()
        return cls(
            s.max_body_bytes,
            s.max_json_depth,
            s.max_json_containers,
            s.max_messages,
            s.max_header_bytes,
            s.max_headers,
            s.max_request_line_bytes,
            s.max_model_chars,
        )


def limit_env() -> dict[str, str]:
    """Limit overrides in our environment, passed on so the gateway and the bench agree."""
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith("FIRSTTOKEN_MAX_") or k == "FIRSTTOKEN_POLICY_THREAD_MIN_BYTES"
    }


# -- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One kind of attacker request: raw HTTP bytes with NONCE placeholders, and the statuses
    a correct gateway answers ("reset": it closed before we read its answer)."""

    kind: str
    template: bytes
    expect: tuple[str, ...]

    def render(self, n: int) -> bytes:
        return self.template.replace(NONCE, str(n).zfill(len(NONCE)).encode())


def http_request(
    body: bytes, fields: Sequence[tuple[str, str]] = (), target: str = "/v1/chat/completions"
) -> bytes:
    head = [
        f"POST {target} HTTP/1.1",
        "host: 127.0.0.1",
        f"authorization: Bearer {ATTACKER_KEY}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in fields),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


BASE_FIELDS = 5  # fields http_request always sends


def attacker_model(limits: Limits) -> str:
    """Unique per request (the nonce), one character under the limit."""
    name = "atk-" + NONCE.decode()
    return (name + "x" * max(0, limits.model_chars - 1 - len(name)))[: limits.model_chars - 1]


# -- sizing -------------------------------------------------------------------------------------


def prose(rng: random.Random, chars: int) -> str:
    """Varied text with what `slim` rewrites: trailing spaces, blank-line runs, zero-width spaces
    and fenced code. ~2 MiB of lines are generated, then reshuffled to reach `chars`."""
    words = [
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 10))) for _ in range(3000)
    ]
    lines, size = [], 0
    while size < min(chars, 2 * 1024 * 1024):
        r = rng.random()
        line = " ".join(rng.choices(words, k=rng.randint(6, 18)))
        if r < 0.05:
            line = f'```json\n{{"id": {rng.randint(0, 10**6)},   "tags": ["{line[:20]}"]}}\n```'
        elif r < 0.10:
            line += "\n\n\n\n\n"
        elif r < 0.20:
            line += "   \t"
        elif r < 0.23:
            line = line.replace(" ", " \u200b", 2)
        lines.append(line)
        size += len(line) + 1
    parts, size = [], 0
    while size < chars:
        rng.shuffle(lines)
        parts.append("\n".join(lines))
        size += len(parts[-1])
    return "\n".join(parts)[:chars]


def containers(body: bytes) -> int:
    """What the gateway counts against max_json_containers: every `{` and `[` byte."""
    return body.count(b"{") + body.count(b"[")


def fill(make: Callable[[int], bytes], target: int) -> bytes:
    """The largest `make(n)` (monotone in n) found within 4 KiB under `target` bytes."""
    n, best = target, b""
    for _ in range(12):
        body = make(max(0, n))
        if len(body) <= target:
            best = max(best, body, key=len)
            if target - len(body) <= 4096:
                break
            n += (target - len(body)) // 2 + 1
        else:
            n -= len(body) - target
    return best


def fill_both(make: Callable[[int, int], bytes], max_containers: int, target: int) -> bytes:
    """`make(units, chars)` with as many structural units as leave its containers at most
    `max_containers`, then string filler up to `target` bytes. Each unit adds the same number
    of containers, and the filler none."""
    empty = containers(make(0, 0))
    per_unit = containers(make(1, 0)) - empty
    units = max(0, (max_containers - empty) // per_unit) if per_unit else 0
    body = fill(lambda chars: make(units, chars), target)
    assert body and containers(body) <= max_containers, "structure alone over the limits"
    return body


# -- bodies -------------------------------------------------------------------------------------


def biggest_body(limits: Limits, pool: str, wide: bool) -> bytes:
    """Eight long messages and eight tools, just under the body limit; `wide`: the tools'
    schemas hold as many properties (one object each) as the container cap allows."""
    roles = ["system"] + ["user", "assistant"] * 3 + ["user"]
    if wide or containers(pool.encode()) > limits.json_containers // 2:
        pool = pool.translate(NO_BRACKETS)  # the text must not spend the cap

    def make(properties: int, chars: int) -> bytes:
        each, step = chars // len(roles), len(pool) // len(roles)
        messages = [
            {"role": role, "content": f"{NONCE.decode()} {i} " + pool[i * step : i * step + each]}
            for i, role in enumerate(roles)
        ]
        tools = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{t}",
                    "description": pool[t * 200 : t * 200 + 200].translate(NO_BRACKETS),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            f"p{j}": {"type": "string"} for j in range(t, properties, 8)
                        },
                    },
                },
            }
            for t in range(8)
        ]
        return orjson.dumps(
            {
                "model": attacker_model(limits),
                "stream": True,
                "messages": messages,
                "tools": tools,
                "user": NONCE.decode(),
                "prompt_cache_key": NONCE.decode() + "k" * 1000,
            }
        )

    if wide:
        return fill_both(make, limits.json_containers, limits.body_bytes - BODY_SLACK)
    return fill(lambda chars: make(0, chars), limits.body_bytes - BODY_SLACK)


def messages_body(limits: Limits, pool: str, extra_parts: int, chars: int) -> bytes:
    """Exactly max_messages messages: strings, content parts, tool calls and results. About
    every 7th is a list of content parts, sharing `extra_parts` more parts; `chars` more
    characters of text are shared by all texts."""
    rng = random.Random("messages")
    plain = pool.translate(NO_BRACKETS)
    n = limits.messages
    kinds = ["system"]
    while len(kinds) < n:
        i = len(kinds)
        if i % 50 == 0 and i + 2 <= n:
            kinds += ["call", "tool"]
        elif i % 7 == 0:
            kinds.append("parts")
        else:
            kinds.append("user" if i % 2 else "assistant")
    if kinds[-1] not in ("parts", "user", "system"):
        kinds[-1] = "user"
    lists = kinds.count("parts") or 1
    each = chars // (n + extra_parts)

    def text() -> str:
        start = rng.randrange(0, max(1, len(plain) - 200 - each))
        return plain[start : start + rng.randint(20, 160) + each]

    messages: list[dict] = []
    q = 0  # lists so far
    for i, kind in enumerate(kinds):
        if kind == "system":
            messages.append({"role": "system", "content": f"{NONCE.decode()} be brief."})
        elif kind == "call":
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": f'{{"q": "{i}"}}'},
                        }
                    ],
                }
            )
        elif kind == "tool":
            messages.append({"role": "tool", "tool_call_id": f"call_{i - 1}", "content": text()})
        elif kind == "parts":
            parts = 1 + extra_parts // lists + (q < extra_parts % lists)
            q += 1
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "text", "text": text()} for _ in range(parts)],
                }
            )
        else:
            messages.append({"role": kind, "content": text()})
    return orjson.dumps({"model": attacker_model(limits), "stream": True, "messages": messages})


def chain(levels: int) -> dict | list:
    """`levels` containers, alternating objects and arrays."""
    node: dict | list = {"leaf": 0}
    for i in range(levels - 1):
        node = {"n": node} if i % 2 else [node]
    return node


def deep_body(
    limits: Limits, depth: int, where: str, pool: str = "", max_containers: int = 0
) -> bytes:
    """Chains reaching exactly `depth` in content parts or tool schemas, plus a last chain one
    level deeper when `depth` is over the limit. Small (one chain) unless `max_containers`:
    then as many chains as keep the body's containers at most that, and text from `pool` in
    every part or tool description up to the body limit."""
    from gateway.boundary.body import nested_deeper_than  # the gateway's own measure of depth

    plain = pool.translate(NO_BRACKETS)

    def wrap(items: list) -> dict:
        body: dict = {"model": attacker_model(limits), "stream": True}
        if where == "parts":
            body["messages"] = [{"role": "user", "content": items}]
        else:
            body["messages"] = [{"role": "user", "content": f"{NONCE.decode()} call a tool"}]
            body["tools"] = items
        return body

    def item(levels: int, text: str = "") -> dict:
        if where == "parts":
            return {
                "type": "text",
                "text": f"{NONCE.decode()} part {text}",
                "x_meta": chain(levels),
            }
        return {
            "type": "function",
            "function": {"name": "deep", "description": text, "parameters": chain(levels)},
        }

    # containers above a chain: body, messages, message, content, part | body, tools, tool, function
    above = 5 if where == "parts" else 4
    levels = min(depth, limits.json_depth - 1) - above
    overflow = [item(depth - above)] if depth >= limits.json_depth else []
    probe = orjson.loads(orjson.dumps(wrap([item(levels), *overflow])))  # more items: no deeper
    assert nested_deeper_than(probe, depth - 1) and not nested_deeper_than(probe, depth)

    def make(units: int, chars: int) -> bytes:
        each = chars // max(1, units)
        step = max(1, (len(plain) - each) // max(1, units))
        items = [item(levels, plain[u * step : u * step + each]) for u in range(units)]
        return orjson.dumps(wrap(items + overflow))

    if not max_containers:
        return make(1, 0)
    return fill_both(make, max_containers, limits.body_bytes - BODY_SLACK)


def pad_fields(count: int, total: int) -> list[tuple[str, str]]:
    """`count` header fields whose lines ("name: value\\r\\n") add up to `total` bytes."""
    fields, left = [], total
    for i in range(count):
        name = f"x-pad-{i:04d}"
        line = left // (count - i)
        fields.append((name, "v" * max(1, line - len(name) - 4)))
        left -= len(name) + 4 + len(fields[-1][1])
    return fields


# -- probes -------------------------------------------------------------------------------------


def header_probes(limits: Limits) -> list[Probe]:
    body = orjson.dumps(
        {
            "model": attacker_model(limits),
            "stream": True,
            "messages": [{"role": "user", "content": f"{NONCE.decode()} hi"}],
        }
    )
    base = http_request(body).index(b"\r\n\r\n") + 4  # the head's bytes
    room = limits.header_bytes - 256 - base
    many = pad_fields(limits.headers - 1 - BASE_FIELDS, room)
    line_base = len("POST /v1/chat/completions?pad= HTTP/1.1")
    line_target = "/v1/chat/completions?pad=" + "p" * (limits.request_line_bytes - 64 - line_base)
    over_target = "/v1/chat/completions?pad=" + "p" * (limits.request_line_bytes + 64 - line_base)
    over = ("431", "reset")
    return [
        Probe("headers<limit", http_request(body, many), ("200",)),
        Probe("1 field<limit", http_request(body, pad_fields(1, room)), ("200",)),
        Probe("line<limit", http_request(body, target=line_target), ("200",)),
        Probe("bytes>limit", http_request(body, pad_fields(1, room + 4096 + 256)), over),
        Probe(
            "fields>limit",
            http_request(
                body, pad_fields(limits.headers + 1 - BASE_FIELDS, (limits.headers + 1) * 16)
            ),
            over,
        ),
        Probe("bytes>>limit", http_request(body, pad_fields(16, 16 * limits.header_bytes)), over),
        Probe("line>limit", http_request(body, target=over_target), ("414", "reset")),
    ]


def deep_probes(limits: Limits, pool: str) -> list[Probe]:
    under, over, cap = limits.json_depth - 1, limits.json_depth + 1, limits.json_containers
    too_many = deep_body(limits, under, "parts", pool, cap + 1000)
    assert containers(too_many) > cap
    return [
        Probe("parts<limit", http_request(deep_body(limits, under, "parts")), ("200",)),
        Probe(
            "tools<limit,full", http_request(deep_body(limits, under, "tools", pool, cap)), ("200",)
        ),
        Probe(
            "parts<limit,full", http_request(deep_body(limits, under, "parts", pool, cap)), ("200",)
        ),
        Probe("parts>limit", http_request(deep_body(limits, over, "parts")), ("400",)),
        Probe(
            "parts>limit,full", http_request(deep_body(limits, over, "parts", pool, cap)), ("400",)
        ),
        Probe("containers>limit,full", http_request(too_many), ("400",)),
    ]


def http_get(target: str) -> bytes:
    head = [
        f"GET {target} HTTP/1.1",
        "host: 127.0.0.1",
        f"authorization: Bearer {ATTACKER_KEY}",
        "connection: close",
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def metrics_probes() -> list[Probe]:
    window = LONGEST_WINDOW_S
    reads = ("200", "429")
    chat = orjson.dumps(
        {
            "model": "atk-metrics",
            "stream": True,
            "messages": [{"role": "user", "content": "hi " + NONCE.decode()}],
        }
    )
    return [
        Probe("ttft", http_get(f"/v1/metrics/ttft?window={window}"), reads),
        Probe("advice", http_get(f"/v1/metrics/cache-advice?window={window}"), reads),
        Probe("series", http_get(f"/v1/metrics/ttft/series?window={window}&step=3600"), reads),
        Probe("ttft,by_api", http_get(f"/v1/metrics/ttft?window={window}&api=chat"), reads),
        Probe("chat", http_request(chat), ("200",)),
    ]


def probes_for(phase: str, limits: Limits) -> list[Probe]:
    rng = random.Random(phase)
    if phase == "mixed":
        return [p for name in PHASES[:4] for p in probes_for(name, limits)]
    if phase == "metrics":
        return metrics_probes()
    if phase == "headers":
        return header_probes(limits)
    if phase == "deep":
        return deep_probes(limits, prose(rng, limits.body_bytes))
    if phase == "biggest":
        pool = prose(rng, limits.body_bytes)
        return [
            Probe("biggest", http_request(biggest_body(limits, pool, False)), ("200",)),
            Probe("biggest,wide", http_request(biggest_body(limits, pool, True)), ("200",)),
        ]
    if phase == "messages":
        pool = prose(rng, 1 << 20)
        light = messages_body(limits, pool, 0, 0)
        if containers(light) > limits.json_containers:  # a low cap: max_messages out of reach
            return [Probe("messages", http_request(light), ("400",))]
        full = fill_both(
            lambda parts, chars: messages_body(limits, pool, parts, chars),
            limits.json_containers,
            limits.body_bytes - BODY_SLACK,
        )
        return [
            Probe("messages", http_request(light), ("200",)),
            # Its tool_call_ids make tenant mode scan it for object ids, and it holds more
            # values than that scan takes (README, "Security model"): a 400 is right too.
            Probe("messages,full", http_request(full), ("200", "400")),
        ]
    raise ValueError(f"unknown phase {phase!r}")


# -- sending ------------------------------------------------------------------------------------


async def exchange(host: str, port: int, data: bytes) -> tuple[str, int]:
    """Send one raw request; (status or "reset"/"closed", bytes sent)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError:
            pass  # the server may have answered early (413/431) and closed
        try:
            line = await reader.readline()
            received = len(line)
            while received < MAX_RESPONSE_BYTES and (chunk := await reader.read(1 << 16)):
                received += len(chunk)
        except ConnectionError:
            return "reset", len(data)
        parts = line.split()
        return (parts[1].decode() if len(parts) > 1 else "closed"), len(data)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


async def attack(url: str, probes: list[Probe], seconds: float, connections: int) -> dict:
    """Each connection sends the probes in rotation, back to back, until `seconds` pass; the
    connections start spread over the list, since a 16 MB probe can take seconds."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    deadline = time.perf_counter() + seconds
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sent = [0]
    nonce = iter(range(10 ** len(NONCE)))

    async def worker(w: int) -> None:
        for j in range(MAX_REQUESTS_PER_CONNECTION):
            if time.perf_counter() >= deadline:
                return
            probe = probes[(w * len(probes) // connections + j) % len(probes)]
            try:
                status, size = await asyncio.wait_for(
                    exchange(host, port, probe.render(next(nonce))), REQUEST_TIMEOUT_S
                )
            except TimeoutError:
                status, size = "timeout", 0
            except OSError as exc:
                status, size = type(exc).__name__, 0
            by_kind[probe.kind][status] += 1
            sent[0] += size

    tasks = [asyncio.create_task(worker(w)) for w in range(connections)]
    _, pending = await asyncio.wait(tasks, timeout=seconds + GRACE_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    expected = {p.kind: p.expect for p in probes}
    unexpected = {
        kind: {s: n for s, n in counts.items() if s not in expected[kind]}
        for kind, counts in by_kind.items()
    }
    statuses = sum(by_kind.values(), collections.Counter())
    return {
        "requests": sum(statuses.values()),
        "statuses": dict(statuses),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "unexpected": {k: v for k, v in unexpected.items() if v},
        "cancelled_in_flight": len(pending),
        "bytes_sent": sent[0],
    }
