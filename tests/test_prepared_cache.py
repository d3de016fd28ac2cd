"""The prepared-weights cache (llmd/daemon/weights/prepared_cache.py): a load writes the weights as
the kernels hold them, later loads map that file; the mapped model is the converted one byte for
byte and computes the same logits; the key follows the file, the settings and the code; a damaged or
hostile file is a miss, never a crash or a wrong model."""

from __future__ import annotations

import gc
import json
import logging
import os
import struct
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model, save_hf_model, write_llama_gguf

from llmd.daemon.attention import make_attention_backend
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.daemon.quantization import QuantConfig
from llmd.daemon.reference_generator import Generator
from llmd.daemon.weights import prepared_cache
from llmd.daemon.weights.cache_files import SUFFIX, data_start
from llmd.quant import int4_fit
from llmd.quant.int4 import Int4Linear
from llmd.quant.int8 import Int8Linear

PROMPT = [3, 17, 42, 99, 5, 8, 61, 23]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache directory of this test's own (the native builds stay shared)."""
    xdg = tmp_path / "xdg"
    (xdg / "llmd").mkdir(parents=True)
    native = Path(os.environ["XDG_CACHE_HOME"]) / "llmd" / "native"
    (xdg / "llmd" / "native").symlink_to(native.resolve(), target_is_directory=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    return prepared_cache.cache_dir()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def gguf_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF in the default model's formats: Q4_1 projections and a Q8_0 head (tied: the
    embedding too), held as they are."""
    hf = make_hf_model("llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                       tie_word_embeddings=request.param)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("g") / "tiny.gguf", quantize_type="Q4_1", head_type="Q8_0")


def load(source, **kwargs):
    """``load_model`` on the native decode step's attention backend."""
    return load_model(source, attention=make_attention_backend("cpu", "cpu"), **kwargs)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("qwen2", hidden_size=128, intermediate_size=256),
                         tmp_path_factory.mktemp("h") / "m", with_tokenizer=True)


def cache_files(cache: Path) -> list[Path]:
    return sorted(cache.glob(f"*{SUFFIX}")) if cache.is_dir() else []


def mapped_files() -> set[str]:
    """The cache files this process maps."""
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if line.rstrip().endswith(SUFFIX)}


def tensors(model) -> dict[str, torch.Tensor]:
    """Every weight the model computes with, as the kernels hold it."""
    out = {name: p for name, p in model.named_parameters()}
    for name, m in model.named_modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            out |= {f"{name}#{k}": getattr(m.native, k) for k in ("w", "scales", "mins")
                    if getattr(m.native, k) is not None}
    if model.head_q8 is not None:
        out |= {"head#w": model.head_q8.matmul.w, "head#scales": model.head_q8.matmul.scales}
    return out


def logits(model) -> torch.Tensor:
    """Prefill logits, then decode steps' (the fused native decode step)."""
    gen = Generator(model)
    return torch.cat((gen.logits(PROMPT), gen.step_logits(PROMPT[:4], PROMPT[4:])))


def assert_same_model(a, b) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name
    assert a.kernels() == b.kernels()
    assert (a.decode_step is None) == (b.decode_step is None)
    assert torch.equal(logits(a), logits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_load_writes_the_cache_and_later_loads_map_it(gguf_path, cache, dtype, caplog) -> None:
    source = resolve_model(gguf_path)
    converted = load(source, dtype=dtype, quant=QuantConfig("auto")).model
    assert cache_files(cache) == []  # off unless asked (the runtime's option asks)

    with caplog.at_level(logging.INFO, logger="llmd"):
        first = load(source, dtype=dtype, quant=QuantConfig("auto"), weights_cache=True).model
    assert "wrote the prepared weights" in caplog.text
    [path] = cache_files(cache)
    assert str(path) in mapped_files()  # the first load serves from the file it wrote, as later ones do
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmd"):
        again = load(source, dtype=dtype, quant=QuantConfig("auto"), weights_cache=True).model
    assert "mapping" in caplog.text and "wrote" not in caplog.text
    assert cache_files(cache) == [path]
    assert again.head_q8 is not None and again.decode_step is not None  # the Q8_0 head, the native step
    assert again.embeds_from_head == again.config.tie_word_embeddings  # a tied table is read from the head
    assert_same_model(converted, first)
    assert_same_model(converted, again)

    del first, again
    gc.collect()
    assert str(path) not in mapped_files()  # unloading the model unmaps the file


def test_q4_0_projections_are_held_and_cached_without_mins(tmp_path, cache) -> None:
    """GGUF Q4_0 blocks (w = d (q - 8)) go to the kernels without mins, which they compute: the
    converted model, the cache file and its mapped load hold none, and compute the same."""
    hf = make_hf_model("llama", vocab_size=512, hidden_size=128, intermediate_size=256)
    source = resolve_model(write_llama_gguf(hf, tmp_path / "q4_0.gguf", quantize_type="Q4_0", head_type="Q8_0"))
    converted = load(source, quant=QuantConfig("auto")).model
    layers = [m for m in converted.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.cpu_path == "native" and m.native.mins is None for m in layers)
    load(source, quant=QuantConfig("auto"), weights_cache=True)
    again = load(source, quant=QuantConfig("auto"), weights_cache=True).model
    assert_same_model(converted, again)  # (tensors() lists mins where a layer holds them)
    [path] = cache_files(cache)
    header = path.read_bytes()[:1 << 16]
    assert b"#scales" in header and b"#mins" not in header


@pytest.mark.parametrize("scheme,group_size", [("int4", 32), ("int8", None), ("int8", 64)])
def test_a_float_checkpoint_is_fitted_once(hf_dir, cache, monkeypatch, scheme, group_size) -> None:
    source = resolve_model(hf_dir)
    quant = QuantConfig(scheme, group_size)
    converted = load(source, quant=quant).model
    load(source, quant=quant, weights_cache=True)

    def no_fit(*args, **kwargs):
        raise AssertionError("a cached load fitted INT4 weights again")

    monkeypatch.setattr(int4_fit, "quantize_int4_fitted", no_fit)
    again = load(source, quant=quant, weights_cache=True).model
    assert str(cache_files(cache)[0]) in mapped_files()
    assert_same_model(converted, again)


def test_the_key_follows_the_file_and_the_settings(gguf_path, tmp_path, cache) -> None:
    path = tmp_path / "copy.gguf"
    path.write_bytes(gguf_path.read_bytes())
    source = resolve_model(path)
    load(source, quant=QuantConfig("auto"), weights_cache=True)
    load(source, quant=QuantConfig("int8"), weights_cache=True)
    load(source, dtype=torch.bfloat16, quant=QuantConfig("auto"), weights_cache=True)
    assert len(cache_files(cache)) == 3  # other settings: other files, kept side by side

    before = set(cache_files(cache))
    os.utime(path, ns=(1, 1))  # a changed file: a new key; its old cache file is removed
    load(source, quant=QuantConfig("auto"), weights_cache=True)
    after = set(cache_files(cache))
    assert len(after) == 3 and len(after - before) == 1

    path.unlink()  # a model that is gone: its files go at the next write
    other = tmp_path / "other.gguf"
    other.write_bytes(gguf_path.read_bytes())
    load(resolve_model(other), quant=QuantConfig("auto"), weights_cache=True)
    assert len(cache_files(cache)) == 1


def test_the_key_follows_the_code(gguf_path, cache, monkeypatch) -> None:
    source = resolve_model(gguf_path)
    key = prepared_cache.cache_key(source, "auto", None, torch.float32)
    assert key == prepared_cache.cache_key(source, "auto", None, torch.float32)
    assert key != prepared_cache.cache_key(source, "auto", None, torch.bfloat16)
    assert key != prepared_cache.cache_key(source, "int4", 32, torch.float32)
    monkeypatch.setattr(prepared_cache, "layout_fingerprint", lambda: "a changed repack")
    assert key != prepared_cache.cache_key(source, "auto", None, torch.float32)
    # every file that converts weights counts: the repack, the fitter, the GGUF reader
    sources = set(prepared_cache.LAYOUT_SOURCES)
    assert {"kernels/cpu/repack.c", "quant", "daemon/weights"} <= sources
    root = Path(prepared_cache.__file__).resolve().parents[2]
    assert all((root / rel).exists() for rel in sources)  # a moved file would silently leave the key


def test_nothing_is_cached_where_the_native_kernels_do_not_hold_it(gguf_path, hf_dir, cache, monkeypatch) -> None:
    load(resolve_model(hf_dir), quant=QuantConfig("none"), weights_cache=True)
    assert cache_files(cache) == []  # dense: nothing converted
    monkeypatch.setenv("LLMD_NATIVE", "0")
    load(resolve_model(gguf_path), quant=QuantConfig("auto"), weights_cache=True)
    assert cache_files(cache) == []


def _rewrite_header(raw: bytes, change) -> bytes:
    """A cache file's bytes with its JSON header edited (same key), the data where it was."""
    n = struct.unpack("<Q", raw[8:16])[0]
    header = json.loads(raw[16:16 + n])
    change(header)
    new = json.dumps(header).encode()
    start = data_start(n)
    assert data_start(len(new)) == start, "the edit must not move the data"
    return raw[:8] + struct.pack("<Q", len(new)) + new + b"\0" * (start - 16 - len(new)) + raw[start:]


def _first(header: dict, suffix: str) -> str:
    return next(name for name in header["tensors"] if name.endswith(suffix))


def _edit(change):
    return lambda raw: _rewrite_header(raw, change)


# Each takes a cache file's bytes and gives them damaged.
DAMAGE = {
    "truncated": lambda raw: raw[:-4096],
    "not a cache file": lambda raw: b"GGUF" + raw[4:],
    "huge header length": lambda raw: raw[:8] + struct.pack("<Q", 2**62) + raw[16:],
    "header not JSON": lambda raw: raw[:16] + b"[" + raw[17:],
    "offset outside the file": _edit(lambda h: h["tensors"][_first(h, "#w")].__setitem__(2, 2**40)),
    "unaligned offset": _edit(lambda h: h["tensors"][_first(h, "#w")].__setitem__(2, 3)),
    "negative dimension": _edit(lambda h: h["tensors"][_first(h, "#scales")].__setitem__(1, [-1, 4, 8])),
    "shape the kernels would overrun": _edit(lambda h: h["tensors"][_first(h, "#w")][1].__setitem__(0, 1)),
    "unknown dtype": _edit(lambda h: h["tensors"][_first(h, "norm.weight")].__setitem__(0, "object")),
    "another projection shape": _edit(lambda h: h["packed"][next(iter(h["packed"]))].__setitem__(1, 8)),
    "a projection missing": _edit(lambda h: h["packed"].pop(next(iter(h["packed"])))),
    "another key": _edit(lambda h: h.__setitem__("key", "0" * 32)),
    "a tensor the model lacks": _edit(lambda h: h["tensors"].__setitem__("evil", ["uint8", [1], 0])),
    "an empty header": _edit(lambda h: h.clear()),
    "a header nested too deep": lambda raw: raw[:8] + struct.pack("<Q", 200_000) + b"[" * 200_000,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_file_is_a_miss_and_is_written_again(gguf_path, cache, damage, caplog) -> None:
    source = resolve_model(gguf_path)
    good = load(source, quant=QuantConfig("auto"), weights_cache=True).model
    [path] = cache_files(cache)
    # (a new file replacing it, as llmd writes: a file changed in place under a live mapping would
    # change, or with a cut, fault the model mapping it, as any mapped model file would)
    damaged = path.with_name("damaged")
    damaged.write_bytes(DAMAGE[damage](path.read_bytes()))
    os.replace(damaged, path)
    with caplog.at_level(logging.INFO, logger="llmd"):
        again = load(source, quant=QuantConfig("auto"), weights_cache=True).model
    assert "not using the weights cache" in caplog.text and "wrote the prepared weights" in caplog.text
    assert_same_model(good, again)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmd"):
        load(source, quant=QuantConfig("auto"), weights_cache=True)  # the file written again maps
    assert "mapping" in caplog.text and "not using" not in caplog.text


def test_an_unwritable_cache_only_costs_time(gguf_path, cache, caplog) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("a file where the directory goes")
    with caplog.at_level(logging.INFO, logger="llmd"):
        model = load(resolve_model(gguf_path), quant=QuantConfig("auto"), weights_cache=True).model
    assert "cannot cache the weights" in caplog.text
    assert logits(model).isfinite().all()
