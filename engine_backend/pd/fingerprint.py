"""A fingerprint of the model a KV cache belongs to, checked before pulled KV is used.

KV computed by another model (or another revision of it) has the right shape and the wrong
values, and nothing downstream would notice. The fingerprint covers config.json and samples
of every weight file (its size and 64 KiB from its start, middle and end): enough to tell
checkpoints of the same shape apart (other seeds, other fine-tunes) while costing
milliseconds on a multi-gigabyte folder. It does not depend on the dtype the engine runs
in, so a bf16 GPU prefill and an fp32 CPU decode of one checkpoint agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from engine_backend.checkpoint import safetensors_files

SAMPLE_BYTES = 64 * 1024


def _sample(path: Path) -> bytes:
    size = os.path.getsize(path)
    parts = [f"{path.name}:{size}".encode()]
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
            f.seek(offset)
            parts.append(f.read(SAMPLE_BYTES))
    return b"".join(parts)


def model_fingerprint(model_dir: str | Path) -> str:
    """32 hex characters naming the checkpoint in `model_dir`."""
    model_dir = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("torch_dtype", None)  # the stored dtype says nothing the weights do not
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in safetensors_files(model_dir):
        digest.update(_sample(path))
    return digest.hexdigest()
