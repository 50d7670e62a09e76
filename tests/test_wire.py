"""The wire format: round trips, and nothing but ProtocolError on arbitrary bytes."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.errors import MessageTooLarge, ProtocolError, VersionMismatch
from kvtransport.wire import SCHEMAS, decode, encode


def test_round_trip_of_every_type() -> None:
    samples = {str: "x", dict: {"a": 1}, bytes: b"\x00\x01", int: 7}
    for kind, schema in SCHEMAS.items():
        fields = {name: samples[t] for name, t in schema.items()}  # type: ignore[index]
        msg = decode(encode(kind, **fields))
        assert msg.type == kind and dict(msg.fields) == fields


def test_encode_refuses_wrong_fields() -> None:
    with pytest.raises(ValueError, match="missing"):
        encode("done", tag="t")
    with pytest.raises(ValueError, match="unknown message type"):
        encode("nope")


@pytest.mark.parametrize(
    ("obj", "error", "words"),
    [
        ({"v": 2, "t": "ping", "seq": 1}, VersionMismatch, "version 2"),
        ({"v": 1, "t": "launch", "seq": 1}, ProtocolError, "unknown message type"),
        ({"v": 1, "t": "ping"}, ProtocolError, "do not match"),
        ({"v": 1, "t": "ping", "seq": "1"}, ProtocolError, "ping.seq must be int"),
        ({"v": 1, "t": "ping", "seq": True}, ProtocolError, "ping.seq must be int"),
        ({"v": 1, "t": "ping", "seq": 1, "extra": 0}, ProtocolError, "do not match"),
        ([1, 2, 3], ProtocolError, "must be a map"),
    ],
)
def test_malformed_messages_get_typed_errors(obj: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        decode(msgpack.packb(obj))


def test_size_limit() -> None:
    big = encode("notice", payload=b"x" * 5000)
    with pytest.raises(MessageTooLarge):
        decode(big, limit=1000)


def test_truncated_message() -> None:
    data = encode("abort", tag="room-1", reason="because")
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])


@settings(max_examples=2000)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_protocol_errors(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.floats(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=1000)
@given(st.dictionaries(st.sampled_from(["v", "t", "tag", "seq", "pages", "aux", "reason", "payload"]), values))
def test_arbitrary_maps_raise_only_protocol_errors(obj: dict[str, object]) -> None:
    try:
        msg = decode(msgpack.packb(obj, use_bin_type=True))
    except ProtocolError:
        return
    schema = SCHEMAS[msg.type]
    assert all(isinstance(msg.fields[k], t) for k, t in schema.items())
