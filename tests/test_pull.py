"""`llmd pull`, `llmd models` and `llmd rm` against a fake hub on loopback (tests/fake_hub.py): a
safetensors repo pulled and then served with no network, a GGUF file picked by its tag, a download
cut short that the next pull resumes, a file whose hash is wrong refused and deleted, and the errors
a user can cause, each one line."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub
from tiny_models import make_hf_model, save_hf_model, write_llama_gguf

from llmd.daemon import hf_cache
from llmd.daemon.model_catalog import human_size
from llmd.daemon.weights import cache_files
from llmd.errors import ModelNotFoundError

pytestmark = pytest.mark.profile_independent


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny") / "m", with_tokenizer=True)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    return files


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("gguf")
    llama = make_hf_model("llama")
    return {q: write_llama_gguf(llama, d / f"{q}.gguf", quantize_type=q).read_bytes() for q in ("Q8_0", "F32")}


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h


def llmd(*argv: str, cache: Path, endpoint: str, offline: bool = False,
         env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "", **(env_extra or {})}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "llmd", *argv], capture_output=True, text=True, env=env, timeout=300,
                          cwd=cache.parent)  # (not the checkout: nothing of it on the path by accident)


def one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The command failed with one `llmd: error:` line holding ``words``, and no traceback."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("llmd: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def listed(cache: Path, endpoint: str) -> dict[str, dict]:
    proc = llmd("models", "--json", cache=cache, endpoint=endpoint, offline=True)
    assert proc.returncode == 0, proc.stderr
    return {m["name"]: m for m in json.loads(proc.stdout)}


def test_a_pulled_safetensors_repo_is_served_with_no_network(hub: FakeHub, tiny_files, tmp_path: Path) -> None:
    extra = {"README.md": b"# tiny\n", "pytorch_model.bin": b"\x80pickle", "onnx/model.onnx": b"onnx"}
    hub.add_repo("org/tiny", tiny_files | extra)
    cache = tmp_path / "cache"
    proc = llmd("pull", "org/tiny", cache=cache, endpoint=hub.url)
    assert proc.returncode == 0, proc.stderr
    assert "pulled org/tiny:" in proc.stdout and "llmd start --model org/tiny" in proc.stdout
    fetched = {path.rsplit("/", 1)[-1] for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path}
    assert fetched == set(tiny_files)  # config, tokenizer, weights: not the README, the pickle or the ONNX
    snapshot = hf_cache.snapshot_of(cache / "models--org--tiny")
    assert snapshot is not None and (cache / "models--org--tiny" / "refs" / "main").is_file()  # other tools find it
    for name, data in tiny_files.items():
        assert (snapshot / name).read_bytes() == data
    assert listed(cache, hub.url)["org/tiny"]["source"] == "hf-cache"

    # served offline: the hub is not asked again (a dead endpoint, and the fake hub's log)
    before = len(hub.requests)
    proc = llmd("generate", "--model", "org/tiny", "--max-tokens", "4", "--temperature", "0", "hi",
                cache=cache, endpoint="http://127.0.0.1:9", offline=True)
    assert proc.returncode == 0, proc.stderr
    assert len(hub.requests) == before

    # pulled again: nothing is downloaded again (the hub's info, and HEADs at most)
    proc = llmd("pull", "org/tiny", cache=cache, endpoint=hub.url)
    assert proc.returncode == 0 and not [r for r in hub.requests[before:] if r[0] == "GET" and "/resolve/" in r[1]]

    # a duplicate of the repo (a copy shares its git history: the same commit hash) is left alone
    hub.add_repo("org/twin", tiny_files)
    assert llmd("pull", "org/twin", cache=cache, endpoint=hub.url).returncode == 0
    proc = llmd("rm", "org/tiny", cache=cache, endpoint=hub.url, offline=True,
                env_extra={"XDG_CACHE_HOME": str(tmp_path / "xdg")})  # (no prepared weights to sweep beside it)
    assert proc.returncode == 0 and "removed org/tiny" in proc.stdout, proc.stderr
    size = sum(len(data) for data in tiny_files.values())
    assert f"({human_size(size)} freed)" in proc.stdout
    models = listed(cache, hub.url)
    assert "org/tiny" not in models and "org/twin" in models and not (cache / "models--org--tiny").exists()


def test_a_gguf_file_is_pulled_by_its_tag(hub: FakeHub, gguf_bytes, tmp_path: Path) -> None:
    hub.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"], "tiny-F32.gguf": gguf_bytes["F32"],
                                   "README.md": b"# gguf\n"})
    cache = tmp_path / "cache"
    one_line_error(llmd("pull", "org/tiny-GGUF", cache=cache, endpoint=hub.url),
                   "has 2 GGUF files; name one", "org/tiny-GGUF:F32", "org/tiny-GGUF:Q8_0")
    one_line_error(llmd("pull", "org/tiny-GGUF:Q4_K_M", cache=cache, endpoint=hub.url), "no GGUF file tagged 'Q4_K_M'")
    proc = llmd("pull", "org/tiny-GGUF:q8_0", cache=cache, endpoint=hub.url)  # any case
    assert proc.returncode == 0 and "pulled org/tiny-GGUF:Q8_0" in proc.stdout, proc.stderr
    assert hub.gets("tiny-F32.gguf") == []
    models = listed(cache, hub.url)
    assert models["org/tiny-GGUF:Q8_0"]["quantization"] == "Q8_0" and "org/tiny-GGUF:F32" not in models

    from huggingface_hub import constants

    from llmd.daemon.model_source import resolve_model

    old = constants.HF_HUB_CACHE
    constants.HF_HUB_CACHE = str(cache)
    try:
        for name in ("org/tiny-GGUF:Q8_0", "org/tiny-GGUF", "org/tiny-GGUF:tiny-Q8_0.gguf"):
            source = resolve_model(name)
            assert source.kind == "gguf" and source.path.read_bytes() == gguf_bytes["Q8_0"]
        with pytest.raises(ModelNotFoundError, match="llmd pull org/else:Q4_0"):
            resolve_model("org/else:Q4_0")
    finally:
        constants.HF_HUB_CACHE = old

    proc = llmd("pull", "org/tiny-GGUF:F32", cache=cache, endpoint=hub.url)
    assert proc.returncode == 0, proc.stderr
    # prepared weights of both files, as loads would have written them: the removed file's go with it
    weights = tmp_path / "xdg" / "llmd" / "weights"
    weights.mkdir(parents=True)
    snapshot = next((cache / "models--org--tiny-GGUF" / "snapshots").iterdir())
    for name, tag in (("q8", "Q8_0"), ("f32", "F32")):
        header = json.dumps({"key": name, "source": str((snapshot / f"tiny-{tag}.gguf").resolve()), "settings": "auto",
                             "packed": {}, "tensors": {}}).encode()
        (weights / f"{name}{cache_files.SUFFIX}").write_bytes(cache_files.MAGIC + struct.pack("<Q", len(header))
                                                              + header + bytes(4096))
    proc = llmd("rm", "org/tiny-GGUF:Q8_0", cache=cache, endpoint=hub.url, offline=True,
                env_extra={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert proc.returncode == 0 and "removed org/tiny-GGUF:Q8_0" in proc.stdout, proc.stderr
    assert sorted(f.name for f in weights.iterdir()) == [f"f32{cache_files.SUFFIX}"]
    assert set(listed(cache, hub.url)) >= {"org/tiny-GGUF:F32"} and "org/tiny-GGUF:Q8_0" not in listed(cache, hub.url)
    blobs = list((cache / "models--org--tiny-GGUF" / "blobs").iterdir())
    assert [b.read_bytes() == gguf_bytes["F32"] for b in blobs] == [True]  # the Q8_0 blob is gone, the F32 stays


def test_an_interrupted_download_resumes_where_it_stopped(hub: FakeHub, tiny_files, tmp_path: Path) -> None:
    """A body cut short mid-file: the pull asks for the rest with a range request (huggingface_hub
    resumes from what it has written, whole chunks of DOWNLOAD_CHUNK_SIZE) and the file is whole.
    A hub that fails outright is one line, leaves no partial file, and the next pull works."""
    from huggingface_hub import constants

    chunk = constants.DOWNLOAD_CHUNK_SIZE
    weights = os.urandom(2 * chunk + 12345)  # the pull checks bytes against the hash: they need not load
    hub.add_repo("org/big", {"config.json": tiny_files["config.json"], "model.safetensors": weights})
    cache = tmp_path / "cache"
    hub.cut["model.safetensors"] = chunk + chunk // 2  # the connection drops half-way through the second chunk
    proc = llmd("pull", "org/big", cache=cache, endpoint=hub.url)
    assert proc.returncode == 0, proc.stderr
    assert hub.gets("model.safetensors") == [None, f"bytes={chunk}-"]  # only the rest was asked for again
    snapshot = hf_cache.snapshot_of(cache / "models--org--big")
    assert (snapshot / "model.safetensors").read_bytes() == weights
    assert not list((cache / "models--org--big" / "blobs").glob("*.incomplete"))

    hub.add_repo("org/down", {"config.json": tiny_files["config.json"], "model.safetensors": weights[:4096]})
    hub.failing.add("model.safetensors")
    one_line_error(llmd("pull", "org/down", cache=cache, endpoint=hub.url), "answered HTTP 500", "try again")
    assert not list((cache / "models--org--down" / "blobs").glob("*.incomplete"))
    hub.failing.clear()
    assert llmd("pull", "org/down", cache=cache, endpoint=hub.url).returncode == 0


def test_a_file_that_fails_its_hash_is_refused_and_deleted(hub: FakeHub, tiny_files, tmp_path: Path) -> None:
    repo = hub.add_repo("org/tampered", tiny_files)
    good = tiny_files["model.safetensors"]
    repo.served["model.safetensors"] = good[:-1] + bytes([good[-1] ^ 1])  # same size: only the hash can tell
    cache = tmp_path / "cache"
    one_line_error(llmd("pull", "org/tampered", cache=cache, endpoint=hub.url),
                   "model.safetensors does not match the hub's sha256", "deleted", "llmd pull")
    assert not [p for p in (cache / "models--org--tampered" / "blobs").iterdir() if p.read_bytes() == repo.served[
        "model.safetensors"]]
    assert "org/tampered" not in listed(cache, hub.url)  # not servable: no weights
    repo.served.clear()
    assert llmd("pull", "org/tampered", cache=cache, endpoint=hub.url).returncode == 0
    assert "org/tampered" in listed(cache, hub.url)


def test_what_a_user_can_get_wrong_is_one_line(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    one_line_error(llmd("pull", "org/missing", cache=cache, endpoint=hub.url), "org/missing is not on", hub.url)
    one_line_error(llmd("pull", "not a repo", cache=cache, endpoint=hub.url), "is not a Hugging Face model")
    one_line_error(llmd("pull", "org/x", cache=cache, endpoint=hub.url, offline=True), "HF_HUB_OFFLINE is set")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    one_line_error(llmd("pull", "org/x", cache=cache, endpoint=dead), "could not fetch org/x", "check the network")
    hub.add_repo("org/pickles", {"config.json": b"{}", "pytorch_model.bin": b"\x80"})
    one_line_error(llmd("pull", "org/pickles", cache=cache, endpoint=hub.url), "no .safetensors weights")
    one_line_error(llmd("rm", "org/nothing", cache=cache, endpoint=hub.url, offline=True), "no pulled model")
    one_line_error(llmd("rm", "SmolLM2-135M-Instruct", cache=cache, endpoint=hub.url, offline=True),
                   "is the default model")


@pytest.mark.parametrize("name,tag", [
    ("SmolLM2-135M-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("llama-2-7b.Q8_0.gguf", "Q8_0"),
    ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"), ("gemma-3-1b-it-UD-Q4_K_XL.gguf", "Q4_K_XL"),
    ("model-bf16.gguf", "BF16"), ("weights.gguf", "weights"), ("phi-IQ2_XXS.gguf", "IQ2_XXS"),
])
def test_gguf_tags(name: str, tag: str) -> None:
    assert hf_cache.gguf_tag(name) == tag


def test_split_gguf_files_are_not_choices() -> None:
    files = ["m-Q4_0-00001-of-00002.gguf", "m-Q4_0-00002-of-00002.gguf", "m-Q8_0.gguf"]
    assert hf_cache.pick_gguf(files, None, "o/m") == "m-Q8_0.gguf"
    with pytest.raises(ModelNotFoundError, match="split GGUF files"):
        hf_cache.pick_gguf(files, "Q4_0", "o/m")
