"""vLLM's disaggregated-serving wire format, as its example proxies and llm-d speak it.

Step 1 asks a prefill server for one token with `kv_transfer_params` saying "a remote server
decodes this"; the server computes the prompt's KV, keeps the blocks and answers a normal
completion whose top-level `kv_transfer_params` names where they are. Step 3 sends the client's
own request to a decode server with that object, which pulls the blocks and generates.

The answer's object is passed on as it came: connectors differ in its fields (NixlConnector's
`remote_block_ids`, `remote_engine_id`, `remote_host`, `remote_port`, newer `remote_request_id`
and `tp_size`; others their own), and only the decode server that reads it needs to understand
it. The gateway only checks that it is a JSON object of bounded size.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.upstreams.base import UpstreamBody

# Step 1's `kv_transfer_params`, exactly as vLLM's proxies send it.
PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Block ids of a million-token prompt at 16 tokens a block fit in well under this.
MAX_KV_PARAMS_BYTES = 1024 * 1024
# Fields that would make a one-token, non-streaming prefill fail or stream; the client's own
# `kv_transfer_params` never reaches either step (a client must not steer where a decode
# server pulls KV from).
PREFILL_DROPPED = frozenset(
    {"stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params"}
)


def prefill_body(body: UpstreamBody) -> UpstreamBody:
    """Step 1: the request as a one-token, non-streaming prefill that keeps its KV for a
    remote decode."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
    return out


def decode_body(body: UpstreamBody, params: dict[str, Any] | None) -> UpstreamBody:
    """Step 3: the client's request with the prefill answer's `kv_transfer_params`; with None,
    an ordinary (colocated) request."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def kv_params_from(answer: bytes) -> dict[str, Any] | None:
    """Step 2: the `kv_transfer_params` object of a prefill answer, or None when it has none
    that can be passed on (absent, null, not an object, or past MAX_KV_PARAMS_BYTES)."""
    if len(answer) > MAX_KV_PARAMS_BYTES * 2:
        # The answer is one token plus the params: anything this big is not worth parsing.
        return None
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    if not isinstance(params, dict) or not params:
        return None
    if len(orjson.dumps(params)) > MAX_KV_PARAMS_BYTES:
        return None
    return params
