"""The KV side channel: a TCP server on the prefill side, a one-shot pull on the decode side.

Framing is in `wire`. The server never touches the cache itself: `export` (the engine
thread's `export_kv`, reached through EngineThread.call) copies a hold's blocks to the host
between two steps and ends the hold; the server then streams that copy block by block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

import numpy as np
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
    the announced block count. The caller checks the token ids against its prompt.

    The pull shares its process (and the GIL) with the engine thread of a decode server, so
    it reads on a plain non-blocking socket straight into two buffers sized up front (token
    ids, K/V) and builds its tensors as views of them: no Python work per element or per
    network chunk beyond one `recv_into`, which releases the GIL while it copies."""
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout_s):
            sock = await _connect(loop, host, port)
            await loop.sock_sendall(sock, wire.encode_hello(transfer_id))
            head = bytearray(wire.REPLY.size)
            await _recv_exactly(loop, sock, memoryview(head))
            status, length = wire.decode_reply_head(bytes(head))
            raw_header = bytearray(length)
            await _recv_exactly(loop, sock, memoryview(raw_header))
            header = orjson.loads(raw_header)
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
            return await _read_blocks(loop, sock, geometry, dtype, len(expected_block_ids))
    except PullError:
        raise
    except TimeoutError as e:
        raise PullError(f"the pull took longer than {timeout_s} s") from e
    except (OSError, ValueError) as e:
        raise PullError(f"the pull failed: {type(e).__name__}: {e}") from e
    finally:
        if sock is not None:
            sock.close()


async def _connect(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to host:port (each resolved address tried)."""
    error: OSError = OSError(f"no address for {host!r}")
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            error = e
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise error


async def _recv_exactly(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
) -> None:
    """Fill `view` in place from the socket; a connection that ends first is a PullError."""
    while view:
        received = await loop.sock_recv_into(sock, view)
        if received == 0:
            raise PullError("the prefill server closed the connection before the end")
        view = view[received:]


async def _read_blocks(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    geometry: wire.KVGeometry,
    dtype: torch.dtype,
    count: int,
) -> KVBlocks:
    size = geometry.block_size
    token_bytes = size * wire.TOKEN_DTYPE.itemsize
    kv_bytes = geometry.kv_elements() * torch.empty((), dtype=dtype).element_size()
    tokens = bytearray(count * token_bytes)
    data = bytearray(count * kv_bytes)
    token_view, kv_view = memoryview(tokens), memoryview(data)
    for i in range(count):  # each frame: its token ids, then its K/V, straight into place
        await _recv_exactly(loop, sock, token_view[i * token_bytes : (i + 1) * token_bytes])
        await _recv_exactly(loop, sock, kv_view[i * kv_bytes : (i + 1) * kv_bytes])
    shape = (
        count,
        2,
        geometry.num_layers,
        size,
        geometry.num_kv_heads,
        geometry.head_dim,
    )
    if not count:
        return KVBlocks([], torch.empty(shape, dtype=dtype))
    token_ids = np.frombuffer(tokens, dtype=wire.TOKEN_DTYPE).tolist()
    return KVBlocks(token_ids, torch.frombuffer(data, dtype=dtype).view(shape))
