"""`llmd generate` end to end: tiny model in-process, the default model as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import hf_greedy, make_hf_model, make_tiny_tokenizer, save_hf_model

from llmd.cli import main


def test_generate_streams_greedy_text(capsys, tmp_path: Path) -> None:
    hf = make_hf_model("qwen2")
    path = save_hf_model(hf, tmp_path / "tiny", with_tokenizer=True)
    tok = make_tiny_tokenizer()
    prompt_ids = tok.encode("Once upon a time")
    expected = tok.decode(hf_greedy(hf, prompt_ids, 12), skip_special_tokens=True)
    code = main(["generate", "Once upon a time", "--model", str(path), "--raw", "--temperature", "0", "--dtype", "float32", "--quant", "none",
                 "--max-tokens", "12"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out == expected + "\n"


def test_generate_chat_template_and_stop(capsys, tmp_path: Path) -> None:
    """--chat renders the prompt through the template, and generation ends at the model's EOS."""
    hf = make_hf_model("llama")
    tok = make_tiny_tokenizer()
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    greedy = hf_greedy(hf, prompt_ids, 20)
    # Declare a token the model will produce as its EOS: output must stop right before it.
    k = next(i for i in range(3, 20) if greedy[i] not in greedy[:i])
    hf.generation_config.eos_token_id = greedy[k]
    path = save_hf_model(hf, tmp_path / "chat", with_tokenizer=True)
    code = main(["generate", "hi", "--model", str(path), "--chat", "--temperature", "0", "--max-tokens", "20",
                 "--dtype", "float32", "--quant", "none"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out == tok.decode(greedy[:k], skip_special_tokens=True) + "\n"


def test_seeded_sampling_is_reproducible(capsys, tmp_path: Path) -> None:
    path = save_hf_model(make_hf_model("llama"), tmp_path / "s", with_tokenizer=True)
    outs = []
    for seed in ("1", "1", "2"):
        assert main(["generate", "x", "--model", str(path), "--raw", "--temperature", "1.0",
                     "--seed", seed, "--max-tokens", "16"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_progress_lines_when_not_a_terminal(capsys, tmp_path: Path) -> None:
    path = save_hf_model(make_hf_model("llama"), tmp_path / "p", with_tokenizer=True)
    assert main(["generate", "x", "--model", str(path), "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "loading p: 0%" in err and "loading p: done" in err


@pytest.mark.slow
def test_default_model_answers_paris_from_the_command_line() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "llmd", "generate", "What is the capital of France?", "--temperature", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr

