"""Resolve a `--model` argument to a local folder: a path as is, else a Hugging Face id.

`huggingface_hub` is imported only when a download is needed, so serving a local folder
works without it and without internet.
"""

from __future__ import annotations

import os

# Only what the engine reads; skips other weight formats (.bin, .gguf, ...) in a repo.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]


class ModelNotFoundError(ValueError):
    """The model argument is neither a folder nor a downloadable Hugging Face id."""


def resolve_model(model: str, *, revision: str | None = None) -> str:
    """Return a local folder holding the model's files, downloading it if needed."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return expanded
    if os.path.exists(expanded):
        raise ModelNotFoundError(f"{model!r} is a file; pass the model's folder")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFoundError(
            f"no model folder at {model!r}, and it is not a Hugging Face id like 'org/name'"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelNotFoundError(
            f"{model!r} is not a local folder and huggingface_hub is not installed "
            "(pip install 'firsttoken[hub]') to download it"
        ) from e
    try:
        return snapshot_download(model, revision=revision, allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as e:  # offline, gated, missing: all end the same way for the user
        raise ModelNotFoundError(
            f"could not download {model!r} from Hugging Face ({type(e).__name__}: {e}); "
            "check the id, your network and HF_TOKEN, or pass a local folder"
        ) from e
