"""A transport for driving the front door's protocol in process, without a socket."""

from __future__ import annotations

import asyncio


class FakeTransport(asyncio.Transport):
    """Keeps what the server writes (`written`, and `heads`: the 200 heads among it, counted as
    they are written) and whether it closed; reading is never paused for real and there is no
    half-close, so a refusal closes at once."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.heads = 0
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 40000) if name in ("sockname", "peername") else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data
        self.heads += bytes(data).count(b"HTTP/1.1 200 ")

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
