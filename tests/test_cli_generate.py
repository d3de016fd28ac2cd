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
# once, not again under the AVX2 profile (make test's time budget): what it adds is the command line;
# the default model's kernels under that profile are test_engine_default_model's, test_decode_step's and
# test_quality's
@pytest.mark.profile_independent
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # one of them is --dtype auto
def test_default_model_continues_paris_from_the_command_line(dtype: str) -> None:
    """The canary through the command line (tests/test_quality.py has its margin, > 4 logits, in
    every setup): the chat prompt with the assistant's answer begun, as a raw prompt."""
    from llmd.daemon.model_source import resolve_model
    from llmd.daemon.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False) + "The capital of France is"
    proc = subprocess.run(
        [sys.executable, "-m", "llmd", "generate", prompt, "--raw", "--temperature", "0", "--max-tokens", "2",
         "--dtype", dtype],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(" Paris"), proc.stdout
    assert "Traceback" not in proc.stderr
