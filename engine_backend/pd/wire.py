"""The KV side channel's framing (version 1). All integers are little-endian.

A decode server connects to the prefill server's side-channel port and sends a hello:

    b"FTKV" | u8 version (1) | u16 n | n bytes: the transfer id (ASCII, at most 256)

The prefill server answers with a reply head:

    b"FTKV" | u8 version | u8 status | u32 n | n bytes: a JSON header (at most 64 KiB)

status 0 (ok): the header is {"engine_id", "fingerprint", "block_size", "num_layers",
"num_kv_heads", "head_dim", "dtype" ("float32" | "bfloat16" | "float16"), "num_blocks",
"block_ids"}, and `num_blocks` block frames follow, in prompt order, each of fixed size:

    block_size x i64 token ids | K and V: [2, num_layers, block_size, num_kv_heads, head_dim]
    elements of `dtype`, C order (K first, then V; layer-major inside each)

then the server closes the connection. status 1 (no such transfer: never made, already
pulled or expired) and status 2 (the server failed) carry {"error": message} and nothing
after. A hold ends as soon as its transfer is read out of the cache, whether or not the
client reads every frame: one transfer id is served at most once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import orjson
import torch

MAGIC = b"FTKV"
VERSION = 1
STATUS_OK, STATUS_UNKNOWN, STATUS_ERROR = 0, 1, 2
MAX_TRANSFER_ID_BYTES = 256
MAX_HEADER_BYTES = 64 * 1024
HELLO = struct.Struct("<4sBH")
REPLY = struct.Struct("<4sBBI")
TOKEN_DTYPE = np.dtype("<i8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireError(ValueError):
    """Bytes that do not follow the format."""


@dataclass(frozen=True)
class KVGeometry:
    """What must match between the two ends for a block to mean the same thing."""

    fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_elements(self) -> int:
        """Elements of K and V together in one block."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim

    def mismatch(self, header: dict) -> str | None:
        """Why a transfer header does not fit this geometry, or None when it does."""
        for name in ("fingerprint", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            if header.get(name) != getattr(self, name):
                return f"{name} differs ({header.get(name)!r}, here {getattr(self, name)!r})"
        return None


def encode_hello(transfer_id: str) -> bytes:
    raw = transfer_id.encode("ascii")
    if not raw or len(raw) > MAX_TRANSFER_ID_BYTES:
        raise WireError(f"a transfer id has 1 to {MAX_TRANSFER_ID_BYTES} ASCII characters")
    return HELLO.pack(MAGIC, VERSION, len(raw)) + raw


def decode_hello_head(head: bytes) -> int:
    """The transfer id's length, from the hello's fixed part."""
    magic, version, length = HELLO.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise WireError("not a version-1 KV side-channel hello")
    if not 0 < length <= MAX_TRANSFER_ID_BYTES:
        raise WireError("bad transfer id length")
    return int(length)


def encode_reply(status: int, header: dict) -> bytes:
    body = orjson.dumps(header)
    return REPLY.pack(MAGIC, VERSION, status, len(body)) + body


def decode_reply_head(head: bytes) -> tuple[int, int]:
    """(status, header length) from the reply's fixed part."""
    magic, version, status, length = REPLY.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise WireError("not a version-1 KV side-channel reply")
    if length > MAX_HEADER_BYTES:
        raise WireError(f"reply header of {length} bytes is over {MAX_HEADER_BYTES}")
    return int(status), int(length)


def encode_tokens(token_ids: list[int]) -> bytes:
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, any dtype (bf16 included)."""
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    return flat.numpy().data
