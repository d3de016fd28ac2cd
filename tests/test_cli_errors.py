"""Errors a user can cause: one clear line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import re
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import gguf_tensor_offset_position, make_hf_model, save_hf_model, write_llama_gguf

from llmd.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["generate", "hello", "--max-tokens", "2", *args])
    err = capsys.readouterr().err
    return code, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("llmd: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("hf") / "tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(make_hf_model("llama"), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_path_does_not_exist(capsys, tmp_path: Path) -> None:
    code, err = run_cli(capsys, "--model", str(tmp_path / "nope"))
    assert code == 1
    assert "not found" in error_line(err) and "nope" in error_line(err)


def test_repo_id_not_in_cache(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    code, err = run_cli(capsys, "--model", "some-org/some-model")
    assert code == 1
    line = error_line(err)
    assert "not in the local Hugging Face cache" in line and "some-org/some-model" in line


def test_directory_without_config(capsys, tmp_path: Path) -> None:
    code, err = run_cli(capsys, "--model", str(tmp_path))
    assert code == 1
    assert "no config.json" in error_line(err)


def test_directory_without_weights(capsys, hf_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((hf_dir / "config.json").read_text())
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 1
    assert "no *.safetensors weights" in error_line(err)


def test_missing_shard(capsys, hf_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(hf_dir, tmp_path / "sharded")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 1
    assert "missing shard(s) model-00002-of-00002.safetensors" in error_line(err)


def test_unsupported_architecture(capsys, hf_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(hf_dir, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 1
    line = error_line(err)
    assert "'gpt2' is not supported" in line
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert name in line


def test_truncated_safetensors(capsys, hf_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(hf_dir, tmp_path / "trunc")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 2 // 3])
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 1
    line = error_line(err)
    assert "truncated" in line and "model.safetensors" in line


def test_safetensors_header_past_end(capsys, hf_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(hf_dir, tmp_path / "hdr")
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 10)
    weights.write_bytes(bytes(data))
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 1
    assert "truncated or corrupt" in error_line(err)


def test_weight_shape_mismatch(capsys, hf_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(hf_dir, tmp_path / "shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 1
    line = error_line(err)
    assert re.search(r"has shape \((64, 128|128, 64)\) but the model config implies \((64, 96|96, 64)\)", line), line


def test_not_a_gguf_file(capsys, tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 100)
    code, err = run_cli(capsys, "--model", str(f))
    assert code == 1
    assert "is not a .gguf file" in error_line(err)


def test_garbage_gguf(capsys, tmp_path: Path) -> None:
    f = tmp_path / "junk.gguf"
    f.write_bytes(os.urandom(4096))
    code, err = run_cli(capsys, "--model", str(f))
    assert code == 1
    assert "truncated or corrupt" in error_line(err)


def test_truncated_gguf(capsys, tiny_gguf: Path, tmp_path: Path) -> None:
    f = tmp_path / "trunc.gguf"
    data = tiny_gguf.read_bytes()
    f.write_bytes(data[: len(data) * 3 // 5])
    code, err = run_cli(capsys, "--model", str(f))
    assert code == 1
    line = error_line(err)
    assert "truncated or corrupt" in line and "trunc.gguf" in line


def test_gguf_offset_past_end_of_file(capsys, tiny_gguf: Path, tmp_path: Path) -> None:
    f = tmp_path / "offset.gguf"
    data = bytearray(tiny_gguf.read_bytes())
    pos = gguf_tensor_offset_position(tiny_gguf, "blk.1.ffn_down.weight")
    data[pos:pos + 8] = struct.pack("<Q", len(data) * 4)  # relative offset far beyond the file
    f.write_bytes(bytes(data))
    code, err = run_cli(capsys, "--model", str(f))
    assert code == 1
    assert "truncated or corrupt" in error_line(err)


def test_gguf_unsupported_tensor_type(capsys, tmp_path: Path) -> None:
    f = write_llama_gguf(make_hf_model("llama"), tmp_path / "iq.gguf", extra_tensor=("blk.0.extra.weight", "IQ2_XXS"))
    code, err = run_cli(capsys, "--model", str(f))
    assert code == 1
    line = error_line(err)
    assert "GGUF type IQ2_XXS" in line and "blk.0.extra.weight" in line and "Q4_1" in line


def test_bad_flag_values_are_usage_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--temperature", "nan"])
    assert exc.value.code == 2
    assert "expected a finite number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--max-tokens", "0"])
    assert exc.value.code == 2


def test_prompt_too_long(capsys, hf_dir: Path) -> None:
    # The tiny model's context is 256 positions.
    code, err = run_cli(capsys, "--model", str(hf_dir), "--max-tokens", "300")
    assert code == 1
    assert "context holds 256" in error_line(err)


def test_missing_tokenizer(capsys, hf_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(hf_dir, tmp_path / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (d / name).unlink(missing_ok=True)
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 1
    assert "has no tokenizer" in error_line(err)


def test_subprocess_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "llmd", "generate", "hi", "--model", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("llmd: error: model")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_start_on_a_gpu_that_is_not_there(capsys, hf_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["start", "--foreground", "--model", str(hf_dir), "--socket-dir", str(tmp_path / "run")]
    assert main([*base, "--device", "cuda"]) == 1
    assert "no CUDA device is available" in error_line(capsys.readouterr().err)
    monkeypatch.delenv("TRITON_INTERPRET")  # the suite runs Triton in its interpreter; a user does not
    assert main([*base, "--attention", "triton"]) == 1
    assert "--attention triton: the Triton attention backend runs on CUDA GPUs" in error_line(capsys.readouterr().err)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main([*base, "--attention", "triton", "--block-size", "64"]) == 1
    assert "need a block size of 16 or 32, got 64; use --attention torch" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "daemon.json").exists()


def test_start_with_a_chat_template_that_is_not_there_or_not_jinja(capsys, hf_dir: Path, tmp_path: Path) -> None:
    base = ["start", "--foreground", "--model", str(hf_dir), "--socket-dir", str(tmp_path / "run")]
    assert main([*base, "--chat-template", str(tmp_path / "nope.jinja")]) == 1
    assert "cannot read the chat template" in error_line(capsys.readouterr().err)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    assert main([*base, "--chat-template", str(tmp_path / "bad.jinja")]) == 1
    assert "does not render a chat" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "daemon.json").exists()


def test_chat_without_a_daemon(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # not a terminal: one line, whatever else
    assert main(["chat", "--socket-dir", str(tmp_path / "run")]) == 1
    assert "llmd chat needs a terminal" in error_line(capsys.readouterr().err)
    # a terminal, no daemon, the question answered "n" (or Ctrl+D): not started, says how
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    for answer in ("n", EOFError()):
        def fake_input(prompt: str, answer=answer) -> str:
            if isinstance(answer, Exception):
                raise answer
            return answer
        monkeypatch.setattr("builtins.input", fake_input)
        assert main(["chat", "--socket-dir", str(tmp_path / "run")]) == 1
        assert "not started; `llmd start` starts it" in capsys.readouterr().err
    assert not (tmp_path / "run" / "daemon.json").exists()
