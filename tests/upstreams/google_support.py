"""What the gemini and vertex route tests share besides the `google` fixture (the mock Google
server, in conftest): a service-account file whose key signs the JWT grant that google-auth
sends to that server's token endpoint."""

from __future__ import annotations

from pathlib import Path

import orjson
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from bench.mock_openai import ThreadedServer

GEMINI_KEY_ENV = "MOCK_GEMINI_KEY"
PRIVATE_KEY_ID = "mock-key-id-0123456789"


def origin(server: ThreadedServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def service_account_file(tmp_path: Path, server: ThreadedServer) -> tuple[Path, str]:
    """A service-account JSON for `server`'s token endpoint (its public key given to the mock),
    and the PEM of its private key (which must never show up anywhere)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server.mock.public_key = key.public_key()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "mock-project",
        "private_key_id": PRIVATE_KEY_ID,
        "private_key": pem,
        "client_email": "gateway@mock-project.iam.gserviceaccount.com",
        "client_id": "1234567890",
        "token_uri": origin(server) + "/token",
    }
    path = tmp_path / "service-account.json"
    path.write_bytes(orjson.dumps(info))
    return path, pem
