"""`llmd models`: the default model, the local Hugging Face cache and the models directory, listed
offline and fast; every listed name is accepted by `--model`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import make_hf_model, save_hf_model, write_llama_gguf

from llmd.daemon import model_catalog
from llmd.daemon.model_catalog import LocalModel, human_size, list_local_models, render_table, to_json
from llmd.daemon.model_source import default_model_path, resolve_model
from llmd.errors import ModelNotFoundError


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture()
def hf_cache(tmp_path: Path, hf_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache laid out as huggingface_hub writes it: blobs, snapshots of symlinks, refs/main."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for f in hf_model_dir.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    # A newer snapshot that refs/main does not name: it must not be the one listed.
    newer = repo / "snapshots" / "newer"
    newer.mkdir()
    (newer / "config.json").write_text(json.dumps({"model_type": "qwen2", "dtype": "bfloat16"}))
    (newer / "model.safetensors").write_bytes(b"x" * 10)
    os.utime(newer, (snapshot.stat().st_mtime + 100,) * 2)
    # Not servable by llmd (no safetensors): not listed.
    (cache / "models--acme--pytorch-only" / "snapshots" / "r").mkdir(parents=True)
    (cache / "models--acme--pytorch-only" / "snapshots" / "r" / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    llama = make_hf_model("llama")
    write_llama_gguf(llama, d / "tiny-q8.gguf", quantize_type="Q8_0")
    write_llama_gguf(llama, d / "tiny-mixed.gguf", quantize_type="Q8_0", per_module={"self_attn.v_proj": "Q4_0"})
    writer = gguf.GGUFWriter(str(d / "qwen-k.gguf"), "qwen2")
    writer.add_token_list(["a", "bc", "<|im_end|>"] * 100)  # arrays before file_type: skipped, not misread
    writer.add_token_scores([0.5] * 300)
    writer.add_array("test.nested", [[1, 2], ["a", "b"]])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (d / "garbage.gguf").write_bytes(os.urandom(4096))
    (d / "truncated.gguf").write_bytes((d / "tiny-q8.gguf").read_bytes()[:300])
    (d / "notes.txt").write_text("not a model")
    gptq = d / "gptq-model"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "float16",
         "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    (gptq / "model.safetensors").write_bytes(b"\0" * 1000)
    one = d / "in-a-folder"
    one.mkdir()
    shutil.copy(d / "tiny-q8.gguf", one / "weights.gguf")
    return d


def by_name(models: list[LocalModel]) -> dict[str, LocalModel]:
    return {m.name: m for m in models}


def test_default_model_is_listed_first() -> None:
    first = list_local_models(None)[0]
    assert (first.name, first.source, first.architecture, first.quantization, first.error) == (
        "SmolLM2-135M-Instruct", "default", "llama", "Q4_1", None)
    assert first.path == default_model_path() and first.size_bytes == first.path.stat().st_size


def test_hf_cache_entry_uses_refs_main_and_counts_each_blob_once(hf_cache: Path, hf_model_dir: Path) -> None:
    snapshot = hf_cache / "models--acme--tiny-llama" / "snapshots" / "abc"
    # Two names for one blob (as a cache can hold after a rename upstream): counted once.
    (snapshot / "copy.safetensors").symlink_to((snapshot / "model.safetensors").readlink())
    models = list_local_models(None)
    hf = [m for m in models if m.source == "hf-cache"]
    assert [m.name for m in hf] == ["acme/tiny-llama"]
    entry = hf[0]
    assert (entry.path, entry.architecture, entry.quantization, entry.error) == (snapshot, "llama", "fp32", None)
    assert entry.size_bytes == (hf_model_dir / "model.safetensors").stat().st_size
    assert models.index(entry) > 0  # after the default model


def test_hf_cache_without_refs_main_takes_the_newest_snapshot(hf_cache: Path) -> None:
    (hf_cache / "models--acme--tiny-llama" / "refs" / "main").unlink()
    entry = by_name(list_local_models(None))["acme/tiny-llama"]
    assert (entry.path.name, entry.architecture, entry.quantization, entry.size_bytes) == ("newer", "qwen2", "bf16", 10)


def test_models_dir_entries(models_dir: Path) -> None:
    models = list_local_models(models_dir)
    assert [m.source for m in models][:1] == ["default"]
    local = by_name([m for m in models if m.source == "models-dir"])
    assert sorted(local) == ["garbage", "gptq-model", "in-a-folder", "qwen-k", "tiny-mixed", "tiny-q8", "truncated"]
    summary = {name: (m.architecture, m.quantization, m.error) for name, m in local.items()}
    assert summary["tiny-q8"] == ("llama", "Q8_0", None)  # F32 norms and embedding aside
    assert summary["tiny-mixed"] == ("llama", "mixed Q8_0/Q4_0", None)
    assert summary["qwen-k"] == ("qwen2", "Q4_K_M", None)  # general.file_type wins over tensor types
    assert summary["gptq-model"] == ("qwen2", "gptq 4-bit", None)
    assert summary["in-a-folder"] == ("llama", "Q8_0", None)
    assert summary["garbage"] == ("?", "?", "not a GGUF file (bad magic)")
    assert summary["truncated"] == ("?", "?", "truncated or corrupt GGUF header")
    assert local["tiny-q8"].size_bytes == (models_dir / "tiny-q8.gguf").stat().st_size
    assert local["gptq-model"].size_bytes == 1000


def test_every_listed_name_resolves_to_its_path(models_dir: Path, hf_cache: Path) -> None:
    for m in list_local_models(models_dir):
        if m.error is None:
            src = resolve_model(m.name, models_dir=models_dir)
            expected = m.path if m.source == "hf-cache" else m.path.resolve()
            assert src.path == expected, m


def test_resolve_catalogue_names(models_dir: Path) -> None:
    assert resolve_model("SmolLM2-135M-Instruct") == resolve_model(None) == resolve_model("smollm2-135m-instruct")
    src = resolve_model("tiny-q8", models_dir=models_dir)
    assert (src.kind, src.path) == ("gguf", (models_dir / "tiny-q8.gguf").resolve())
    assert resolve_model("tiny-q8.gguf", models_dir=models_dir) == src
    assert resolve_model("gptq-model", models_dir=models_dir).kind == "hf_dir"
    assert resolve_model("tiny-q8", models_dir=str(models_dir)) == src  # the config gives a str


def test_unknown_name_points_to_llmd_models(models_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"name from `llmd models`.*put \.gguf files in"):
        resolve_model("no-such-model", models_dir=models_dir)
    with pytest.raises(ModelNotFoundError, match="llmd models"):
        resolve_model("tiny-q8")  # no models dir given: not looked up


def test_render_table_and_json(models_dir: Path, tmp_path: Path) -> None:
    models = list_local_models(models_dir)
    lines = render_table(models, models_dir).splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "ARCH", "QUANT", "SOURCE"]
    assert lines[1].split() == ["SmolLM2-135M-Instruct", "94", "MiB", "llama", "Q4_1", "default"]
    assert len({line.index("SOURCE" if i == 0 else "default") for i, line in enumerate(lines[:2])}) == 1
    garbage = next(line for line in lines if line.startswith("garbage "))
    assert garbage.endswith("unreadable: not a GGUF file (bad magic)")
    assert str(models_dir) not in "\n".join(lines)  # it holds models: no hint
    empty = tmp_path / "empty"
    assert f"No models in {empty}: put .gguf files there" in render_table(list_local_models(empty), empty)
    data = json.loads(json.dumps(to_json(models)))
    assert data[0]["name"] == "SmolLM2-135M-Instruct" and data[0]["path"] == str(default_model_path())
    assert set(data[0]) == {"name", "source", "path", "size_bytes", "architecture", "quantization", "error"}


def test_human_size() -> None:
    assert [human_size(n) for n in (0, 1023, 1536, 98_362_432, 5 * 2**30)] == [
        "0 B", "1023 B", "1.5 KiB", "94 MiB", "5.0 GiB"]


def test_type_tables_agree_with_gguf() -> None:
    assert model_catalog._GGML_TYPES.items() <= {int(t): t.name for t in gguf.GGMLQuantizationType}.items()
    file_types = {int(t): t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in gguf.LlamaFileType}
    assert model_catalog._FILE_TYPES.items() <= file_types.items()


def test_listing_is_light_and_honours_hf_hub_cache(hf_cache: Path, models_dir: Path) -> None:
    code = (
        "import json, sys; from pathlib import Path\n"
        "from llmd.daemon.model_catalog import list_local_models, to_json\n"
        f"models = to_json(list_local_models(Path({str(models_dir)!r})))\n"
        "print(json.dumps({'names': [m['name'] for m in models],\n"
        "                  'heavy': [m for m in ('torch', 'transformers', 'numpy', 'gguf') if m in sys.modules]}))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=models_dir)
    result = json.loads(out.stdout)
    assert result["heavy"] == []
    assert result["names"][:2] == ["SmolLM2-135M-Instruct", "acme/tiny-llama"] and "tiny-q8" in result["names"]


def test_llmd_models_command_reads_models_dir_from_the_config(models_dir: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from llmd.cli import main
    from llmd.config import config_path

    config_path().parent.mkdir(parents=True, exist_ok=True)
    config_path().write_text(f'models_dir = "{models_dir}"\n')
    assert main(["models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed["tiny-q8"]["quantization"] == "Q8_0" and listed["tiny-q8"]["source"] == "models-dir"
    assert listed["garbage"]["error"]
    assert resolve_model("tiny-q8").path == models_dir / "tiny-q8.gguf"  # the configured dir, by default
    assert main(["models", "--models-dir", str(models_dir / "in-a-folder")]) == 0  # the flag wins
    out = capsys.readouterr().out
    assert "tiny-q8" not in out and "SmolLM2-135M-Instruct" in out
