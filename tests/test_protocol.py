"""The wire format: signing, decoding and validation, fuzzed; and a scan for forbidden patterns."""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.protocol import (
    PROTOCOL, REQUEST_TYPES, ProtocolError, SignatureError, decode, encode, parse_messages, parse_token_ids,
    sign,
)

KEY = b"k" * 32
ROOT = Path(__file__).resolve().parents[1]


def test_round_trip() -> None:
    frames = encode(KEY, "generate", {"request_id": "a", "prompt": "hi"})
    msg = decode(KEY, frames, REQUEST_TYPES)
    assert msg.type == "generate" and msg.content == {"request_id": "a", "prompt": "hi"}


def test_wrong_key_or_tampering_is_a_signature_error() -> None:
    frames = encode(KEY, "health", {})
    with pytest.raises(SignatureError):
        decode(b"x" * 32, frames, REQUEST_TYPES)
    tampered = frames[:3] + [msgpack.packb({"evil": 1})]
    with pytest.raises(SignatureError):
        decode(KEY, tampered, REQUEST_TYPES)
    with pytest.raises(SignatureError):
        decode(KEY, [frames[0], b"", frames[2], frames[3]], REQUEST_TYPES)


def signed(header: object, content: object = None, raw_content: bytes | None = None) -> list[bytes]:
    h = msgpack.packb(header)
    c = raw_content if raw_content is not None else msgpack.packb(content if content is not None else {})
    return [PROTOCOL, sign(KEY, h, c), h, c]


@pytest.mark.parametrize("frames", [
    [b"x"], [PROTOCOL, b"", b""], [b"llmd/2", b"", b"", b""],
    signed({"v": 2, "id": "1", "type": "health"}),
    signed({"v": 1, "id": "", "type": "health"}),
    signed({"v": 1, "id": "1" * 65, "type": "health"}),
    signed({"v": 1, "id": "1", "type": "exec"}),  # answered with an error by the server
    signed({"v": 1, "id": "1", "type": "health", "parent": 5}),
    signed([1, 2, 3]),
    signed({"v": 1, "id": "1", "type": "health"}, raw_content=b"\xc1"),  # reserved msgpack byte
    signed({"v": 1, "id": "1", "type": "health"}, raw_content=msgpack.packb([1])),
    signed({"v": 1, "id": "1", "type": "health"}, raw_content=b"\xa2\xff\xfe"),  # invalid UTF-8 str
    signed({"v": 1, "id": "1", "type": "health"}, raw_content=b"\xd4\x01\x00"),  # ext type
])
def test_malformed_frames_are_rejected(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode(KEY, frames, REQUEST_TYPES)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_frames_never_crash_the_decoder(frames: list[bytes]) -> None:
    try:
        decode(KEY, frames, REQUEST_TYPES)
    except ProtocolError:
        pass


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(header=_json, content=_json)
def test_signed_garbage_is_rejected_or_well_formed(header: object, content: object) -> None:
    """Correctly signed but arbitrary maps: either a clean ProtocolError or a message whose header
    fields have the documented types."""
    try:
        msg = decode(KEY, signed(header, content), REQUEST_TYPES)
    except ProtocolError:
        return
    assert msg.type in REQUEST_TYPES and isinstance(msg.msg_id, str) and isinstance(msg.content, dict)


@settings(max_examples=200, deadline=None)
@given(_json)
def test_field_parsers_accept_only_their_shapes(value: object) -> None:
    for parser in (parse_messages, parse_token_ids):
        try:
            out = parser(value)
        except ProtocolError:
            continue
        assert isinstance(out, list) and out


def test_no_pickle_eval_or_unsafe_torch_load_in_the_code() -> None:
    pattern = re.compile(r"\bpickle\b|recv_pyobj|send_pyobj|(?<![\w.])eval\(|(?<![\w.])exec\(|torch\.load\(")
    offenders = []
    for folder in ("llmd", "daemon", "kernels", "quant", "tui"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "weights_only=True" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []
