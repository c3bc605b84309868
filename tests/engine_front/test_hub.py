"""Resolving --model: folders as they are, Hugging Face ids through huggingface_hub."""

from __future__ import annotations

import pytest

from engine_backend.hub import ModelNotFoundError, resolve_model


def test_existing_folder_is_used_as_is(tiny_model_dir: str) -> None:
    assert resolve_model(tiny_model_dir) == tiny_model_dir


@pytest.mark.parametrize(
    "model, message",
    [
        ("./missing-model", "no model folder"),
        ("/abs/missing", "no model folder"),
        ("a/b/c", "not a Hugging Face id"),
    ],
)
def test_paths_that_are_not_folders(model: str, message: str) -> None:
    with pytest.raises(ModelNotFoundError, match=message):
        resolve_model(model)


def test_a_file_is_not_a_model(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(str(path))


def test_offline_hub_id_gives_a_clear_error(monkeypatch, tmp_path) -> None:
    pytest.importorskip("huggingface_hub")
    # Offline mode makes huggingface_hub answer from its (empty) cache: no network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="could not download 'firsttoken/no-such-model'"):
        resolve_model("firsttoken/no-such-model")
