"""Two real `python -m engine_backend.server` processes, a prefill and a decode server, talking
through the real KV side channel: exactness, then the faults (a tampered transfer, a hold
nobody pulls, the held-blocks bound, a prefill server killed while holding blocks).

The test plays the router. The colocated reference is the prefill server itself, asked
ordinary requests under a salt of their own, so that no PD request's blocks are reused.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.harness import ROOT, free_port, wait_http
from engine_backend.pd import wire
from tests.engine_pd.step1 import STEP1

BLOCK = 4
HOLD_S = 2.0
MAX_HELD = 60
LONG = " ".join(f"rule {i}: keep answers short and cite sources." for i in range(7))


class Server:
    def __init__(self, model_dir: str, role: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine_backend.server",
                "--model",
                model_dir,
                "--port",
                str(self.port),
                "--role",
                role,
                "--block-size",
                str(BLOCK),
                "--num-blocks",
                "128",
                "--max-num-batched-tokens",
                "256",
                "--log-level",
                "warning",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def status(self) -> dict:
        return self.client.get("/pd/status").json()

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def servers(pd_model_dir: str) -> Iterator[tuple[Server, Server]]:
    prefill = Server(
        pd_model_dir,
        "prefill",
        "--pd-hold-s",
        str(HOLD_S),
        "--pd-max-held-blocks",
        str(MAX_HELD),
    )
    decode = Server(pd_model_dir, "decode", "--pd-pull-timeout-s", "5")
    try:
        for server in (prefill, decode):
            wait_http(server.url + "/healthz", timeout=90)
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def assert_pools_full(*servers: Server) -> None:
    for server in servers:
        deadline = time.monotonic() + 10
        while True:
            status = server.status()
            idle = status["running"] == status["waiting"] == status["held_blocks"] == 0
            if idle and status["free_blocks"] == status["total_blocks"]:
                break
            assert time.monotonic() < deadline, f"pool not full again: {status}"
            time.sleep(0.05)


def body(prompt: str, **extra) -> dict:
    return {
        "model": "m",
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def step1(prefill: Server, request: dict) -> dict:
    first = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": STEP1}
    response = prefill.client.post(
        "/v1/completions", json=first, headers={"X-Request-Id": "pd-test"}
    )
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def step3(decode: Server, request: dict, params: dict) -> tuple[str, int]:
    """The decode server's streamed text and its cached-token count."""
    second = {**request, "stream": True, "stream_options": {"include_usage": True}}
    second["kv_transfer_params"] = params
    text, cached = "", -1
    with decode.client.stream("POST", "/v1/completions", json=second) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return text, cached


_salts = iter(range(10**6))


def colocated(prefill: Server, request: dict) -> str:
    alone = {**request, "cache_salt": f"reference-{next(_salts)}"}
    response = prefill.client.post("/v1/completions", json=alone)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_disaggregated_equals_colocated_across_processes(servers) -> None:
    prefill, decode = servers
    cases = [("Hi", {}), (LONG, {}), (LONG, {"temperature": 0.8, "seed": 5}), ("one two", {})]
    for prompt, extra in cases:
        request = body(prompt, **extra)
        expected = colocated(prefill, request)
        params = step1(prefill, request)
        text, cached = step3(decode, request, params)
        assert text == expected
        assert cached == len(params["remote_block_ids"]) * BLOCK
    # A second turn on the decode server hits what it pulled, and still matches.
    turn2 = body(LONG + " " + text + " and one more question?")
    assert step3(decode, turn2, {})[0] == colocated(prefill, turn2)
    assert decode.status()["pulls"]["ok"] == 3
    assert_pools_full(prefill, decode)


def test_concurrent_disaggregated_requests(servers) -> None:
    prefill, decode = servers
    requests = [body(f"{LONG[:120]} variant {i}", seed=i, temperature=0.7) for i in range(4)]
    expected = [colocated(prefill, r) for r in requests]

    def one(request: dict) -> str:
        return step3(decode, request, step1(prefill, request))[0]

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, requests)) == expected
    assert_pools_full(prefill, decode)


def test_a_hold_nobody_pulls_is_freed_after_its_timeout(servers) -> None:
    prefill, decode = servers
    params = step1(prefill, body(LONG + " unpulled"))
    held = prefill.status()
    assert held["held_blocks"] == len(params["remote_block_ids"]) > 0
    assert held["free_blocks"] == held["total_blocks"] - held["held_blocks"]
    time.sleep(HOLD_S + 0.3)
    assert_pools_full(prefill)
    assert prefill.status()["expired_holds"] >= 1
    # Pulling it now fails cleanly: the decode server computes the prompt itself.
    request = body(LONG + " unpulled", cache_salt="timeout")
    text, cached = step3(decode, request, params)
    assert text == colocated(prefill, request) and cached == 0
    assert decode.status()["pulls"]["failed"] >= 1
    assert_pools_full(prefill, decode)


def test_past_the_held_blocks_bound_prefill_answers_503(servers) -> None:
    prefill, _ = servers
    long_prompt = {**body(" ".join([LONG] * 3)), "max_tokens": 1, "kv_transfer_params": STEP1}
    response = prefill.client.post("/v1/completions", json=long_prompt)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "kv_hold_limit"
    # Ordinary requests of that size are still served.
    ordinary = {k: v for k, v in long_prompt.items() if k != "kv_transfer_params"}
    assert prefill.client.post("/v1/completions", json=ordinary).status_code == 200
    assert_pools_full(prefill)


def tampering_server(
    fingerprint: str, prompt_tokens: list[int], num_blocks: int, tamper: bool = True
) -> tuple:
    """A side channel that announces the right model and zero KV, under other tokens when
    `tamper` (else under the prompt's own: such KV is wrong and still taken, see the test)."""
    loop = asyncio.new_event_loop()
    geometry = {"block_size": BLOCK, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
    tokens = list(prompt_tokens[: num_blocks * BLOCK])
    if tamper:
        tokens[1] += 1

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = wire.decode_hello_head(await reader.readexactly(wire.HELLO.size))
        await reader.readexactly(length)
        header = {
            "engine_id": "evil",
            "fingerprint": fingerprint,
            **geometry,
            "dtype": "float32",
            "num_blocks": num_blocks,
            "block_ids": list(range(num_blocks)),
        }
        writer.write(wire.encode_reply(wire.STATUS_OK, header))
        kv_bytes = 2 * 2 * BLOCK * 2 * 16 * 4
        for i in range(num_blocks):
            writer.write(wire.encode_tokens(tokens[i * BLOCK : (i + 1) * BLOCK]))
            writer.write(bytes(kv_bytes))
        await writer.drain()
        writer.close()

    started = threading.Event()
    holder: dict = {}

    def run() -> None:
        async def main() -> None:
            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            holder["port"] = server.sockets[0].getsockname()[1]
            holder["server"] = server
            started.set()
            await server.serve_forever()

        try:
            loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)

    def stop() -> None:
        loop.call_soon_threadsafe(holder["server"].close)
        thread.join(5)

    return holder["port"], stop


def test_a_tampered_transfer_is_refused(servers, pd_model_dir: str) -> None:
    prefill, decode = servers
    from engine_backend.tokenizer import Tokenizer

    request = body(LONG + " tampered", cache_salt="tampered")
    tokens = Tokenizer(pd_model_dir).encode(request["prompt"], add_special_tokens=True)
    num_blocks = (len(tokens) - 1) // BLOCK
    port, stop = tampering_server(prefill.status()["fingerprint"], tokens, num_blocks)
    try:
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "evil",
            "remote_block_ids": list(range(num_blocks)),
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_request_id": "xfer-evil",
        }
        refused = decode.status()["pulls"]["refused"]
        text, cached = step3(decode, request, params)
        assert cached == 0 and text == colocated(prefill, request)
        assert decode.status()["pulls"]["refused"] == refused + 1
    finally:
        stop()
    # The same bytes under the prompt's own tokens are taken: the refusal above was the
    # token check (the KV itself cannot be checked without recomputing it).
    port, stop = tampering_server(prefill.status()["fingerprint"], tokens, num_blocks, False)
    try:
        own = body(request["prompt"], cache_salt="zero-kv")
        _, cached = step3(decode, own, {**params, "remote_port": port})
        assert cached == num_blocks * BLOCK
    finally:
        stop()
    assert_pools_full(decode)


def test_prefill_killed_while_holding_blocks(servers) -> None:
    """Last in this module: it kills the prefill server."""
    prefill, decode = servers
    request = body(LONG + " orphaned", cache_salt="orphaned")
    expected = colocated(prefill, request)
    params = step1(prefill, request)
    assert prefill.status()["held_blocks"] > 0
    prefill.proc.kill()
    prefill.proc.wait(10)
    failed = decode.status()["pulls"]["failed"]
    text, cached = step3(decode, request, params)
    assert text == expected and cached == 0
    assert decode.status()["pulls"]["failed"] == failed + 1
    assert_pools_full(decode)
