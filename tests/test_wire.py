"""The wire format: round trips, and nothing but ProtocolError on arbitrary bytes."""

from __future__ import annotations

import msgpack
import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.negotiation.hello import PROTOCOL_VERSION
from kvtransport.runtime.wire import MAX_DONE_NOTICES, MAX_INT, TYPES, Done, decode, encode
from kvtransport.spi.errors import ConfigError, MessageTooLarge, ProtocolError, VersionMismatch

from .schema_strategies import conforms, unwrap


def _sample(t: mi.Type) -> object:
    t = unwrap(t)
    if isinstance(t, mi.IntType):
        return 7
    if isinstance(t, mi.StrType):
        return "x"
    if isinstance(t, mi.BytesType):
        return b"\x00\x01"
    if isinstance(t, mi.DictType):
        return (
            {_sample(t.key_type): _sample(t.value_type)}
            if not isinstance(unwrap(t.value_type), mi.AnyType)
            else {"a": 1}
        )
    assert isinstance(t, mi.ListType)
    return [b"\x01" * 8]


def _fields(kind: str) -> dict[str, object]:
    info = mi.type_info(TYPES[kind])
    assert isinstance(info, mi.StructType)
    return {f.name: _sample(f.type) for f in info.fields if f.name != "v"}


def test_round_trip_of_every_type() -> None:
    for kind in TYPES:
        fields = _fields(kind)
        msg = decode(encode(kind, **fields))
        assert msg.type == kind and isinstance(msg, TYPES[kind])
        assert {name: msg[name] for name in fields} == fields


@pytest.mark.parametrize("value", [-(2**63), -2, 2**62, 2**63 - 1, 2**64 - 1])
def test_integers_outside_their_range_are_refused_at_decode(value: int) -> None:
    """An aux of 2**64-1 once reached numpy and raised OverflowError on the I/O thread."""
    with pytest.raises(ProtocolError, match="outside"):
        decode(
            msgpack.packb(
                {"v": PROTOCOL_VERSION, "t": "expect", "tag": "t", "pages": b"", "aux": value, "prefix": 0, "state": []}
            )
        )


def test_strings_longer_than_their_field_are_refused() -> None:
    with pytest.raises(ProtocolError, match="at most 256"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "t": "abort", "tag": "x" * 257, "reason": "r"}))
    # encode cuts a long reason instead of failing to report the failure
    assert len(decode(encode("abort", tag="t", reason="y" * 10_000))["reason"]) <= 4096


def test_encode_refuses_wrong_fields() -> None:
    with pytest.raises(ValueError, match="missing"):
        encode("done", tag="t")
    with pytest.raises(ValueError, match="unknown message type"):
        encode("nope")


@pytest.mark.parametrize(
    ("obj", "error", "words"),
    [
        ({"v": 1, "t": "ping", "seq": 1}, VersionMismatch, "version 1"),
        ({"v": PROTOCOL_VERSION, "t": "launch", "seq": 1}, ProtocolError, "unknown message type"),
        ({"v": PROTOCOL_VERSION, "t": "ping"}, ProtocolError, "ping fields do not match its schema: 'seq' is missing"),
        ({"v": PROTOCOL_VERSION, "t": "ping", "seq": "1"}, ProtocolError, "ping.seq must be an integer"),
        ({"v": PROTOCOL_VERSION, "t": "ping", "seq": True}, ProtocolError, "ping.seq must be an integer"),
        ({"v": PROTOCOL_VERSION, "t": "ping", "seq": 1.0}, ProtocolError, "ping.seq must be an integer, got a number"),
        ({"v": PROTOCOL_VERSION, "t": "ping", "seq": MAX_INT + 1}, ProtocolError, "outside"),
        ({"v": PROTOCOL_VERSION, "t": "ping", "seq": 1, "extra": 0}, ProtocolError, "do not match"),
        ({"t": "ping", "seq": 1}, VersionMismatch, "version None"),
        ({"v": True, "t": "ping", "seq": 1}, VersionMismatch, "version True"),
        ({"v": 1, "t": "launch", "seq": 1}, VersionMismatch, "version 1"),
        (
            {"v": PROTOCOL_VERSION, "t": "done", "tag": "t", "bytes": 1, "lane": "", "notices": [1]},
            ProtocolError,
            r"done\.notices\[0\] must be bytes",
        ),
        ([1, 2, 3], ProtocolError, "must be a map"),
    ],
)
def test_malformed_messages_get_typed_errors(obj: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        decode(msgpack.packb(obj))


def test_size_limit() -> None:
    big = encode("notice", payload=b"x" * 5000, lane="")
    with pytest.raises(MessageTooLarge):
        decode(big, limit=1000)


def test_the_size_limit_follows_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The parsed limit is kept between messages; a changed variable still takes effect.
    notice = encode("notice", payload=b"x" * 5000, lane="")
    monkeypatch.setenv("KVTRANSPORT_MAX_MESSAGE_BYTES", "1000")
    with pytest.raises(MessageTooLarge, match="1000-byte limit"):
        decode(notice)
    with pytest.raises(MessageTooLarge, match="1000-byte limit"):
        encode("notice", payload=b"x" * 5000, lane="")
    monkeypatch.setenv("KVTRANSPORT_MAX_MESSAGE_BYTES", "ten")
    with pytest.raises(ConfigError, match="KVTRANSPORT_MAX_MESSAGE_BYTES='ten'"):
        decode(notice)
    with pytest.raises(ConfigError):
        decode(notice)  # a bad value is not remembered as good
    monkeypatch.delenv("KVTRANSPORT_MAX_MESSAGE_BYTES")
    assert decode(notice)["payload"] == b"x" * 5000


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
    # What got through is what the schema says, checked by the tests' own reading of it.
    assert conforms(msgspec.msgpack.decode(msgspec.msgpack.encode(msg)), mi.type_info(TYPES[msg.type]))


@settings(max_examples=300, deadline=None)
@given(
    tag=st.text(max_size=300),
    nbytes=st.integers(0, MAX_INT),
    lane=st.text(max_size=80),
    notices=st.lists(st.binary(max_size=300), max_size=MAX_DONE_NOTICES),
)
def test_a_done_packed_in_two_steps_is_the_done_encode_packs(
    tag: str, nbytes: int, lane: str, notices: list[bytes]
) -> None:
    """``Done`` packs all but the notices ahead and the notices at the end: the bytes are
    exactly ``encode``'s for the same fields (long texts cut the same way), and decode back."""
    two_steps = Done(tag, nbytes, lane).encode(notices)
    assert two_steps == encode("done", tag=tag, bytes=nbytes, lane=lane, notices=list(notices))
    assert decode(two_steps)["notices"] == notices


def test_a_done_packed_in_two_steps_keeps_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRANSPORT_MAX_MESSAGE_BYTES", "1024")
    done = Done("t", 1, "")
    assert decode(done.encode([b"x" * 900]))["notices"] == [b"x" * 900]
    with pytest.raises(MessageTooLarge):
        done.encode([b"x" * 1100])
    with pytest.raises(MessageTooLarge):
        done.encode([b"x" * 600] * 2)
