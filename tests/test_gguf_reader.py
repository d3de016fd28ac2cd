"""llmd's GGUF header reader against the ``gguf`` package's reader, the reference: the same fields,
tensor infos and bytes, on a file with every value kind and on the default model; and every cut or
garbled file refused with GGUFFormatError, nothing else."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from llmd.daemon.model_source import default_model_path
from llmd.daemon.weights.gguf_reader import GGUFFormatError, GGUFReader, StringArray

Q = gguf.GGMLQuantizationType


def _reference_value(field: gguf.ReaderField) -> object:
    return field.contents()


def _ours_as_python(value: object) -> object:
    if isinstance(value, StringArray):
        return list(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _write_every_kind(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.strs", ["a", "", "ü" * 300, "<|im_end|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.empty", [])
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5)).astype(np.float16))
    for name, qtype in (("q8", Q.Q8_0), ("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1)):
        x = rng.standard_normal((4, 256)).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.add_tensor("q6k", rng.integers(0, 256, (4, 210), dtype=np.uint8), raw_dtype=Q.Q6_K)  # one block a row
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same(path: Path, keys: list[str] | None = None) -> None:
    ref, ours = gguf.GGUFReader(str(path)), GGUFReader(path)
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == ref_keys
    for key in keys if keys is not None else ref_keys:
        assert _ours_as_python(ours.field(key)) == _reference_value(ref.fields[key]), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.type_name == theirs.tensor_type.name
        assert mine.shape == tuple(reversed(theirs.shape.tolist()))
        assert (mine.offset, mine.n_bytes, mine.n_elements) == (theirs.data_offset, theirs.n_bytes, theirs.n_elements)
        got = ours.data(mine)
        assert got.dtype == theirs.data.dtype and got.shape == theirs.data.shape
        np.testing.assert_array_equal(got, theirs.data)


def test_every_value_kind_and_tensor_type_reads_as_the_reference(tmp_path: Path) -> None:
    path = _write_every_kind(tmp_path / "kinds.gguf")
    _assert_same(path)
    ours = GGUFReader(path)
    assert ours.field("t.strs")[2] == "ü" * 300 and ours.field("t.strs")[-1] == "<|im_end|>"
    assert ours.field("t.strs")[1:3] == ["", "ü" * 300]
    assert ours.field("missing", 7) == 7


def test_the_default_model_reads_as_the_reference() -> None:
    path = default_model_path()
    ref, ours = gguf.GGUFReader(str(path)), GGUFReader(path)
    tokens = ours.field("tokenizer.ggml.tokens")
    assert len(tokens) == len(ref.fields["tokenizer.ggml.tokens"].data) > 40_000
    field = ref.fields["tokenizer.ggml.tokens"]
    for i in (0, 1, 2, 100, 12_345, len(tokens) - 1):  # a sample: the whole list through gguf is seconds
        assert tokens[i] == str(bytes(field.parts[field.data[i]]), "utf-8")
    scalar_keys = [k for k, f in ref.fields.items() if not k.startswith("GGUF.") and len(f.data) == 1]
    _assert_same(path, keys=scalar_keys)


def test_every_cut_of_the_file_is_a_format_error(tmp_path: Path) -> None:
    data = _write_every_kind(tmp_path / "kinds.gguf").read_bytes()
    data_start = GGUFReader(tmp_path / "kinds.gguf").data_offset
    cut = tmp_path / "cut.gguf"
    # every byte of the header, then steps through the data (a cut there ends inside a tensor)
    for n in [*range(0, data_start + 1), *range(data_start + 1, len(data), 97)]:
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFFormatError):
            GGUFReader(cut)


def test_garbled_headers_are_format_errors_or_read(tmp_path: Path) -> None:
    """Random bytes written over the header: the reader refuses with GGUFFormatError or reads a
    file whose every tensor lies inside it; it never fails another way, never allocates what a
    garbled count claims."""
    data = _write_every_kind(tmp_path / "kinds.gguf").read_bytes()
    header = GGUFReader(tmp_path / "kinds.gguf").data_offset
    rng = random.Random(1)
    bad = tmp_path / "bad.gguf"
    refused = 0
    for _ in range(400):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(4, header)
            b[pos:pos + 8] = rng.randbytes(8)[: len(b[pos:pos + 8])]
        bad.write_bytes(bytes(b))
        try:
            r = GGUFReader(bad)
        except GGUFFormatError:
            refused += 1
            continue
        for t in r.tensors:
            if t.type_name in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K"):
                assert t.offset + t.n_bytes <= len(b) and r.data(t).nbytes == t.n_bytes
    assert refused > 100  # most garbling is caught, not read as something else


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv(key: str, type_id: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", type_id) + payload


@pytest.mark.parametrize(("blob", "says"), [
    (b"GGML" + bytes(20), "magic"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    (_header(version=1), "version 1"),
    (_header(n_tensors=2**40), "more than the file can hold"),
    (_header(n_kv=1) + _kv("general.alignment", 4, struct.pack("<I", 48)), "power of two"),
    (_header(n_kv=1) + _kv("x", 9, struct.pack("<IQ", 8, 2**50)), "ends inside metadata x"),
    (_header(n_kv=1) + _kv("x", 9, struct.pack("<IQ", 9, 1)), "array of type 9"),
    (_header(n_kv=1) + _kv("x", 13, b""), "unknown value type 13"),
    (_header(n_kv=1) + _kv("x", 8, struct.pack("<Q", 2) + b"\xff\xfe"), "not UTF-8"),
])
def test_malformed_headers_say_what_is_wrong(tmp_path: Path, blob: bytes, says: str) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(blob + bytes(8))
    with pytest.raises(GGUFFormatError, match=says):
        GGUFReader(path)


def test_a_tensor_listed_twice_is_refused(tmp_path: Path) -> None:
    info = struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 32, 0, 0)
    path = tmp_path / "twice.gguf"
    path.write_bytes(_header(n_tensors=2) + info + info + bytes(256))
    with pytest.raises(GGUFFormatError, match="listed twice"):
        GGUFReader(path)


def test_metadata_of_the_wrong_type_is_a_clear_error(tmp_path: Path) -> None:
    """A count given as a string (a garbled or hand-made file) is InvalidModelError, not a crash."""
    from llmd.daemon.weights.gguf_file import GGUFModelFile
    from llmd.errors import InvalidModelError

    w = gguf.GGUFWriter(str(tmp_path / "typed.gguf"), "llama")
    for key in ("embedding_length", "attention.head_count", "feed_forward_length"):
        w.add_uint32(f"llama.{key}", 64)
    w.add_string("llama.block_count", "two")
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InvalidModelError, match="wrong type"):
        GGUFModelFile(tmp_path / "typed.gguf").config()
