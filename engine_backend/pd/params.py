"""The `kv_transfer_params` request field, as vLLM's disaggregated serving spells it.

Step 1 of the protocol (router -> prefill server) carries `do_remote_decode: true`; the
prefill server's answer carries the params of step 3 (router -> decode server):
`do_remote_prefill: true` with `remote_engine_id`, `remote_block_ids`, `remote_host`,
`remote_port` and `remote_request_id` (the transfer to pull). Unknown keys (vLLM adds
`tp_size`, for one) are ignored; known ones are type- and range-checked, with a 400 that
names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_backend.pd.wire import MAX_TRANSFER_ID_BYTES
from engine_backend.request_fields import EngineRequestError

FIELD = "kv_transfer_params"
MAX_KEYS = 32
MAX_HOST_CHARS = 255
MAX_ENGINE_ID_CHARS = 256
# A bound on the list alone; the decode server also refuses more blocks than the prompt has.
MAX_REMOTE_BLOCKS = 1 << 17


@dataclass(frozen=True)
class RemoteDecode:
    """Step 1: prefill the prompt here and hold its KV for a decode server."""


@dataclass(frozen=True)
class RemotePrefill:
    """Step 3: the prompt's KV waits on a prefill server; pull it, then decode here."""

    engine_id: str | None
    block_ids: list[int]
    host: str
    port: int
    transfer_id: str


def _bad(message: str) -> EngineRequestError:
    return EngineRequestError(f"{FIELD}: {message}", FIELD)


def _optional_str(params: dict, name: str, limit: int) -> str | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise _bad(f"'{name}' must be a string of 1 to {limit} characters")
    return value


def _flag(params: dict, name: str) -> bool:
    value = params.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean")
    return value


def _block_ids(params: dict) -> list[int]:
    value = params.get("remote_block_ids")
    if not isinstance(value, list) or len(value) > MAX_REMOTE_BLOCKS:
        raise _bad(f"'remote_block_ids' must be a list of at most {MAX_REMOTE_BLOCKS} ids")
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**31 for b in value):
        raise _bad("'remote_block_ids' must hold non-negative integers")
    return list(value)


def parse(body: dict) -> RemoteDecode | RemotePrefill | None:
    """The request's PD step, or None for an ordinary request."""
    params: Any = body.get(FIELD)
    if params is None:
        return None
    if not isinstance(params, dict) or len(params) > MAX_KEYS:
        raise _bad(f"must be an object of at most {MAX_KEYS} keys")
    remote_decode = _flag(params, "do_remote_decode")
    remote_prefill = _flag(params, "do_remote_prefill")
    engine_id = _optional_str(params, "remote_engine_id", MAX_ENGINE_ID_CHARS)
    if remote_decode and remote_prefill:
        raise _bad("'do_remote_decode' and 'do_remote_prefill' cannot both be true")
    if remote_decode:
        return RemoteDecode()
    if not remote_prefill:
        return None
    host = _optional_str(params, "remote_host", MAX_HOST_CHARS)
    port = params.get("remote_port")
    transfer_id = _optional_str(params, "remote_request_id", MAX_TRANSFER_ID_BYTES)
    if host is None:
        raise _bad("'remote_host' is required with 'do_remote_prefill'")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _bad("'remote_port' must be an integer between 1 and 65535")
    if transfer_id is None or not transfer_id.isascii():
        raise _bad("'remote_request_id' (an ASCII string) is required with 'do_remote_prefill'")
    return RemotePrefill(engine_id, _block_ids(params), host, port, transfer_id)


def prefill_answer(
    engine_id: str, block_ids: list[int], host: str, port: int, transfer_id: str
) -> dict:
    """The `kv_transfer_params` a prefill server returns, for the router to pass on."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": transfer_id,
    }
