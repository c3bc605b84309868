"""The KV side channel: a TCP server on the prefill side, a one-shot pull on the decode side.

Framing is in `wire`. The server never touches the cache itself: `export` (the engine
thread's `export_kv`, reached through EngineThread.call) copies a hold's blocks to the host
between two steps and ends the hold; the server then streams that copy block by block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import orjson
import torch

from engine_backend.pd import wire
from engine_backend.pd.kv_blocks import KVBlocks

logger = logging.getLogger(__name__)

# A hello must arrive this fast; a stalled client must not pin a connection forever.
HELLO_TIMEOUT_S = 10.0

Export = Callable[[str], Awaitable[tuple[list[int], KVBlocks] | None]]


class PullError(RuntimeError):
    """The transfer could not be pulled; the decode server computes the prompt itself."""


class PullRefused(PullError):
    """The transfer arrived but does not fit this engine (another model or shape, blocks
    other than the announced ones)."""


class KVSideChannelServer:
    """Serves held transfers to decode servers, each transfer once."""

    def __init__(self, export: Export, header: dict) -> None:
        self._export = export
        self._header = header  # engine_id, fingerprint, geometry and dtype
        self._server: asyncio.Server | None = None
        self.port = 0
        self.num_served = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):  # closing; the clients are gone either way
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                length = wire.decode_hello_head(await reader.readexactly(wire.HELLO.size))
                transfer_id = (await reader.readexactly(length)).decode("ascii")
            exported = await self._export(transfer_id)
            if exported is None:
                writer.write(wire.encode_reply(wire.STATUS_UNKNOWN, {"error": "no such transfer"}))
            else:
                await self._send(writer, *exported)
                self.num_served += 1
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            logger.info("KV side channel: dropped a connection (%s)", type(e).__name__)
        except Exception:  # the server must outlive any one connection (logged)
            logger.exception("KV side channel: serving a transfer failed")
            with contextlib.suppress(Exception):  # best effort; the client may be gone
                writer.write(wire.encode_reply(wire.STATUS_ERROR, {"error": "server error"}))
        finally:
            writer.close()
            with contextlib.suppress(Exception):  # the peer may have reset the connection
                await writer.wait_closed()

    async def _send(
        self, writer: asyncio.StreamWriter, block_ids: list[int], blocks: KVBlocks
    ) -> None:
        size = int(self._header["block_size"])
        header = {
            **self._header,
            "dtype": wire.DTYPE_NAMES[blocks.kv.dtype],
            "num_blocks": blocks.num_blocks,
            "block_ids": block_ids,
        }
        writer.write(wire.encode_reply(wire.STATUS_OK, header))
        for i in range(blocks.num_blocks):
            writer.write(wire.encode_tokens(blocks.token_ids[i * size : (i + 1) * size]))
            writer.write(wire.tensor_bytes(blocks.kv[i]))
            await writer.drain()


async def pull_kv(
    host: str,
    port: int,
    transfer_id: str,
    *,
    geometry: wire.KVGeometry,
    expected_block_ids: list[int],
    timeout_s: float,
) -> KVBlocks:
    """Pull one transfer. Refuses (PullError) a header that does not fit this engine (another
    model, block size or shape), a block list other than the one the prefill server announced,
    or any malformed or short stream; the whole pull is bounded by `timeout_s`, and its size by
    the announced block count. The caller checks the token ids against its prompt."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(wire.encode_hello(transfer_id))
            await writer.drain()
            status, length = wire.decode_reply_head(await reader.readexactly(wire.REPLY.size))
            header = orjson.loads(await reader.readexactly(length))
            if not isinstance(header, dict):
                raise PullError("the transfer header is not an object")
            if status != wire.STATUS_OK:
                raise PullError(f"the prefill server refused: {header.get('error')!r}")
            reason = geometry.mismatch(header)
            if reason is not None:
                raise PullRefused(f"the transfer is for another engine shape or model: {reason}")
            dtype = wire.DTYPES.get(str(header.get("dtype")))
            if dtype is None:
                raise PullRefused(f"unsupported KV dtype {header.get('dtype')!r}")
            if header.get("block_ids") != expected_block_ids or header.get("num_blocks") != len(
                expected_block_ids
            ):
                raise PullRefused("the transfer's blocks are not the ones announced")
            return await _read_blocks(reader, geometry, dtype, len(expected_block_ids))
    except PullError:
        raise
    except TimeoutError as e:
        raise PullError(f"the pull took longer than {timeout_s} s") from e
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        raise PullError(f"the pull failed: {type(e).__name__}: {e}") from e
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):  # the peer may be gone already
                await writer.wait_closed()


async def _read_blocks(
    reader: asyncio.StreamReader, geometry: wire.KVGeometry, dtype: torch.dtype, count: int
) -> KVBlocks:
    size = geometry.block_size
    token_bytes = size * wire.TOKEN_DTYPE.itemsize
    kv_bytes = geometry.kv_elements() * torch.empty((), dtype=dtype).element_size()
    data = bytearray(count * kv_bytes)
    tokens: list[int] = []
    for i in range(count):
        tokens.extend(wire.decode_tokens(await reader.readexactly(token_bytes)))
        data[i * kv_bytes : (i + 1) * kv_bytes] = await reader.readexactly(kv_bytes)
    shape = (
        count,
        2,
        geometry.num_layers,
        size,
        geometry.num_kv_heads,
        geometry.head_dim,
    )
    kv = torch.frombuffer(data, dtype=dtype).view(shape) if count else torch.empty(shape)
    return KVBlocks(tokens, kv)
