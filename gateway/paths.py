"""Passthrough paths: which `/v1/*` paths may reach an upstream, and the URL they reach.

The client's path is read raw (`scope["raw_path"]`, before the server decodes it) and must be
plain: segments of RFC 3986 path characters, percent-escapes only for characters that are
themselves allowed, no dot segments, no encoded dots or separators (`%2f %5c %3f %23 %25 %00`),
no empty segments, no control characters. Anything else is a 400 before routing, so no
decoding or normalising done later (by us, aiohttp, yarl, a proxy or the upstream) can turn the
path into another one. The first segment must name a known OpenAI path family (an unknown one
is a 404), and the upstream URL is built from the route's own base URL and the re-encoded
segments, never by concatenating strings, so the route's key only ever reaches its own origin.

The module also knows the REST shape of the object families (`/v1/files/{id}/content`,
`/v1/fine_tuning/jobs/{id}/cancel`, ...): which path is a collection and which segment is the
id of a top-level object, which is what tenant ownership checks need.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote

from yarl import URL

from gateway.errors import GatewayError

# Path families the gateway forwards. `chat` and `completions` are the hot paths (served only as
# POST /v1/chat/completions and /v1/completions); realtime and chatkit mint client secrets for
# the route's account, and organization/projects are the account's admin API: never forwarded.
FAMILIES: frozenset[str] = frozenset(
    {
        "assistants",
        "audio",
        "batches",
        "containers",
        "conversations",
        "embeddings",
        "evals",
        "files",
        "fine_tuning",
        "images",
        "models",
        "moderations",
        "responses",
        "threads",
        "uploads",
        "vector_stores",
        "videos",
    }
)

# Families whose creates return objects a tenant owns, with the collection's path (after /v1/).
OBJECT_COLLECTIONS: dict[str, tuple[str, ...]] = {
    **{
        name: (name,)
        for name in (
            "assistants",
            "batches",
            "containers",
            "conversations",
            "evals",
            "files",
            "responses",
            "threads",
            "uploads",
            "vector_stores",
            "videos",
        )
    },
    "fine_tuning": ("fine_tuning", "jobs"),
}
# Second-level words of an object collection that are actions, not ids.
COLLECTION_ACTIONS: frozenset[tuple[str, str]] = frozenset(
    {
        ("responses", "input_tokens"),
        ("responses", "compact"),
        ("threads", "runs"),
    }
)

# Paths that take multipart (or raw) uploads; `*` stands for one id segment. In tenant mode
# every other body must be JSON, which is what the reference checks read.
UPLOAD_PATHS: tuple[tuple[str, ...], ...] = (
    ("files",),
    ("uploads", "*", "parts"),
    ("images", "edits"),
    ("images", "variations"),
    ("audio", "transcriptions"),
    ("audio", "translations"),
    ("containers", "*", "files"),
    ("videos",),
    ("videos", "*", "remix"),
)

# Azure OpenAI (`azure` routes). The families Azure serves (the rest answer 404 there); of them,
# the JSON paths Azure scopes to a deployment (`/openai/deployments/{name}/...`, the deployment
# named by the body's `model`), as its own SDK does. Multipart ones (transcriptions, image
# edits) carry the model inside the form, which is streamed, not read: not forwarded.
AZURE_FAMILIES: frozenset[str] = frozenset(
    {"audio", "batches", "embeddings", "files", "fine_tuning", "images", "models", "vector_stores"}
)
AZURE_DEPLOYMENT_PATHS: frozenset[tuple[str, ...]] = frozenset(
    {("embeddings",), ("audio", "speech"), ("images", "generations")}
)
AZURE_MULTIPART_DEPLOYMENT_PATHS: frozenset[tuple[str, ...]] = frozenset(
    {("audio", "transcriptions"), ("audio", "translations"), ("images", "edits")}
)
# A deployment name, which becomes a path segment: Azure allows letters, digits, '-', '_' and
# '.', up to 64 characters; the first must be a letter or digit (so never '.' or '..').
_AZURE_DEPLOYMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_AZURE_API_VERSION = re.compile(r"v1|\d{4}-\d{2}-\d{2}(-preview)?")


def is_azure_deployment(name: str) -> bool:
    """Whether `name` may be a deployment's path segment (no '/', '..', '?', '#', '%')."""
    return _AZURE_DEPLOYMENT.fullmatch(name) is not None


def is_azure_api_version(version: str) -> bool:
    """`v1` (the OpenAI-compatible surface), or a dated `api-version` like `2024-10-21`."""
    return _AZURE_API_VERSION.fullmatch(version) is not None


MAX_SEGMENTS = 16
MAX_PATH_BYTES = 2048
MAX_QUERY_FIELDS = 64
SEGMENT_SAFE = "!$&'()*+,;=:@"  # pchar minus unreserved (RFC 3986 §3.3), as the SDK
QUERY_SAFE = "!$'()*+,;:@"  # query chars minus '&', '=', '/' and '?'
_RAW_SEGMENT = re.compile(rb"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})+")
_PLAIN_SEGMENT = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@]+")
_ENCODED_DOT = re.compile(rb"%2e", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class PassPath:
    """A validated passthrough target: decoded segments after `/v1/` and the parsed query."""

    segments: tuple[str, ...]
    query: tuple[tuple[str, str], ...] = ()

    @property
    def family(self) -> str:
        return self.segments[0]

    @property
    def collection(self) -> tuple[str, ...] | None:
        """The object collection this path lies in (`("files",)`), or None."""
        prefix = OBJECT_COLLECTIONS.get(self.family)
        if prefix is not None and self.segments[: len(prefix)] == prefix:
            return prefix
        return None

    @property
    def is_collection(self) -> bool:
        """`/v1/files`: POST creates, GET lists."""
        prefix = self.collection
        return prefix is not None and len(self.segments) == len(prefix)

    @property
    def object_id(self) -> str | None:
        """The top-level object this path reads, changes or reaches into (`/v1/files/{id}/...`)."""
        prefix = self.collection
        if prefix is None or len(self.segments) <= len(prefix):
            return None
        word = self.segments[len(prefix)]
        if (self.family, word) in COLLECTION_ACTIONS:
            return None
        return word

    @property
    def is_object(self) -> bool:
        """Exactly `/v1/files/{id}`: a DELETE here removes the object."""
        prefix = self.collection
        return (
            prefix is not None
            and len(self.segments) == len(prefix) + 1
            and self.object_id is not None
        )

    @property
    def takes_upload(self) -> bool:
        """Whether a multipart or raw (non-JSON) body is expected here."""
        return any(
            len(p) == len(self.segments)
            and all(w == "*" or w == s for w, s in zip(p, self.segments, strict=False))
            for p in UPLOAD_PATHS
        )

    def display(self) -> str:
        return "/v1/" + "/".join(self.segments)[:200]


def fixed_path(*segments: str) -> PassPath:
    """A path the gateway itself names (Anthropic's `messages`, `messages/count_tokens`), never
    one a client sent: plain segments only (a ValueError otherwise, a bug of ours), and no
    family check, since these paths are not in OpenAI's families. Client paths still go
    through `parse_target`."""
    if not segments or len(segments) > MAX_SEGMENTS:
        raise ValueError(f"a fixed path needs 1 to {MAX_SEGMENTS} segments")
    for segment in segments:
        if segment in (".", "..") or not _PLAIN_SEGMENT.fullmatch(segment):
            raise ValueError(f"not a plain path segment: {segment[:40]!r}")
    return PassPath(tuple(segments))


def bad_path(message: str) -> GatewayError:
    return GatewayError(400, message, code="invalid_path")


def parse_target(raw_path: bytes, query_string: bytes = b"") -> PassPath:
    """Validate a raw `/v1/...` request path and its query; raise a 400 or 404 GatewayError."""
    if not raw_path.startswith(b"/v1/"):
        raise bad_path("The request path must start with /v1/ and not be encoded.")
    rest = raw_path[4:]
    if len(rest) > MAX_PATH_BYTES:
        raise bad_path(f"The request path is longer than {MAX_PATH_BYTES} bytes.")
    raw_segments = rest.split(b"/")
    if len(raw_segments) > MAX_SEGMENTS:
        raise bad_path(f"The request path has more than {MAX_SEGMENTS} segments.")
    segments = []
    for raw in raw_segments:
        if not raw:
            raise bad_path("The request path has an empty segment ('//' or a trailing '/').")
        if not _RAW_SEGMENT.fullmatch(raw) or _ENCODED_DOT.search(raw):
            raise bad_path(
                "The request path has a character or escape that is not allowed "
                "(encoded dots, separators or control characters)."
            )
        segment = unquote(raw.decode("ascii"), errors="replace") if b"%" in raw else raw.decode()
        if segment in (".", "..") or not _PLAIN_SEGMENT.fullmatch(segment):
            raise bad_path(
                "The request path has a dot segment or an encoded character that "
                "is not allowed ('/', '\\', '?', '#', '%', control characters)."
            )
        segments.append(segment)
    path = PassPath(tuple(segments), parse_query(query_string))
    if path.family not in FAMILIES:
        hint = (
            " Chat and completions are served only as POST /v1/chat/completions and "
            "POST /v1/completions."
            if path.family in ("chat", "completions")
            else ""
        )
        raise GatewayError(404, f"Unknown path {path.display()}.{hint}", code="unknown_url")
    return path


def parse_query(query_string: bytes) -> tuple[tuple[str, str], ...]:
    if not query_string:
        return ()
    try:
        pairs = parse_qsl(
            query_string.decode("ascii"),
            keep_blank_values=True,
            strict_parsing=False,
            errors="strict",
            max_num_fields=MAX_QUERY_FIELDS,
        )
    except (UnicodeDecodeError, ValueError):
        raise bad_path(
            f"The query string is not valid (at most {MAX_QUERY_FIELDS} fields of "
            "percent-encoded UTF-8)."
        ) from None
    return tuple(pairs)


@functools.lru_cache(maxsize=64)
def parse_base(base_url: str) -> URL:
    """The route's base URL, parsed once; its query and fragment are not used."""
    return URL(base_url.rstrip("/"))


def upstream_url(base_url: str, path: PassPath) -> URL:
    """The route's base URL plus the re-encoded segments and query: same origin by construction."""
    base = parse_base(base_url)
    raw_path = (
        base.raw_path.rstrip("/")
        + "/"
        + "/".join(quote(s, safe=SEGMENT_SAFE) for s in path.segments)
    )
    query = "&".join(
        quote(k, safe=QUERY_SAFE) + "=" + quote(v, safe=QUERY_SAFE) for k, v in path.query
    )
    url = URL.build(
        scheme=base.scheme,
        authority=base.raw_authority,
        path=raw_path,
        query_string=query,
        encoded=True,
    )
    if url.origin() != base.origin():  # cannot happen; the key must never go elsewhere
        raise GatewayError(500, "Internal gateway error.")
    return url
