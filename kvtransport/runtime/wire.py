"""Control messages: schema, version, size limit and strict validation on decode.

Every message is a msgpack map ``{"v": PROTOCOL_VERSION, "t": <type>, ...fields}``. Each type
has a schema (field -> expected Python type); :func:`decode` checks size, framing, version,
type and every field before anything else sees the message, and raises only
:class:`~kvtransport.spi.errors.ProtocolError` (or a subclass) on bad input, whatever the bytes.
"""

from __future__ import annotations

import functools
import os
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvtransport.negotiation.hello import PROTOCOL_VERSION
from kvtransport.spi.env import env_int
from kvtransport.spi.errors import MessageTooLarge, ProtocolError, VersionMismatch

#: Default largest control message (a hello with connection info is a few KiB; a destination
#: announcement for a 128k-token prompt is about 64 KiB).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
ENV_MAX_MESSAGE_BYTES = "KVTRANSPORT_MAX_MESSAGE_BYTES"

#: The largest integer any field may carry: everything the protocol counts (bytes, pages, slots)
#: fits in a signed 62-bit number, so no arithmetic on a checked value can overflow int64/uint64.
MAX_INT = (1 << 62) - 1


#: The variable's text and its value, parsed again only when the text changes: every message
#: sent and received reads the limit, and parsing it each time cost a third of an encode.
_parsed_limit: tuple[str, int] = ("", DEFAULT_MAX_MESSAGE_BYTES)


def max_message_bytes() -> int:
    global _parsed_limit
    raw = os.environ.get(ENV_MAX_MESSAGE_BYTES, "")
    if raw != _parsed_limit[0]:
        # A bad value raises here each time (nothing is cached for it), as before.
        _parsed_limit = (raw, env_int(ENV_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, {ENV_MAX_MESSAGE_BYTES: raw}))
    return _parsed_limit[1]


@dataclass(frozen=True)
class Int:
    """An integer field and its inclusive range."""

    lo: int = 0
    hi: int = MAX_INT


@dataclass(frozen=True)
class Text:
    """A string field of at most ``max_len`` characters."""

    max_len: int = 4096


Field = type | Int | Text

# Message types and their fields. ``bytes`` fields carry packed int64 page arrays or driver
# payloads; ``dict`` fields carry documents validated by their own parsers (hello, regions).
SCHEMAS: dict[str, dict[str, Field]] = {
    # The authentication exchange, the only messages sent unsealed (auth.py, docs/security.md).
    # initiator -> acceptor: a connection id and a fresh nonce
    "auth": {"conn": Text(64), "nonce": bytes},
    # acceptor -> initiator: the acceptor's fresh nonce
    "challenge": {"conn": Text(64), "nonce": bytes},
    # either side, initiator first: both nonces echoed, and an HMAC of the secret over the
    # sender's role, the id and both nonces
    "proof": {"conn": Text(64), "nonce_i": bytes, "nonce_a": bytes, "mac": bytes},
    # initiator -> acceptor: open a connection; ``lanes``: driver name -> the connection info of
    # the receiving side that driver made for this connection alone (``receives_per_peer``;
    # read by ``read_lanes``), used instead of the hello's endpoint-wide one
    "hello": {"conn": Text(64), "hello": dict, "regions": dict, "lanes": dict},
    # acceptor -> initiator: accepted, with the acceptor's hello and the decision it computed
    "welcome": {
        "conn": Text(64),
        "hello": dict,
        "regions": dict,
        "decision": dict,
        "express": Int(0, 65535),
        "lanes": dict,
    },
    # initiator -> acceptor, the first frame on an express stream (express.py), sealed with the
    # session's express key: binds the stream to connection ``conn``; ``express`` in the welcome
    # is the acceptor's express port (0: none)
    "express": {"conn": Text(64)},
    # acceptor -> initiator: refused, with the reason
    "refuse": {"conn": Text(64), "reason": Text()},
    # receiver -> sender: pages of transfer ``tag`` go to these destination pages (aux -1: none);
    # ``prefix``: how much of the sequence the receiver holds already (the application's unit;
    # SGLang: decode_prefix_len tokens), so the sender sends only what follows; ``state``: per
    # state group, the destination items (packed int64, empty: none) the last chunk fills
    "expect": {"tag": Text(256), "pages": bytes, "aux": Int(-1), "prefix": Int(), "state": list},
    # sender -> receiver: every byte of ``tag`` is in place, moved by the driver ``lane`` names
    # (one of the connection's lanes; "": the chosen driver); ``notices``: payloads for that
    # (two-sided) driver, each handled as a "notice" of ``lane`` before the "done" itself (the
    # notices of a transfer whose one batch finished on the thread that sends its "done")
    "done": {"tag": Text(256), "bytes": Int(), "lane": Text(64), "notices": list},
    # either side: the transfer failed or was aborted
    "abort": {"tag": Text(256), "reason": Text()},
    # sender -> receiver, after a failure or abort of ``tag`` (or an abort of a tag it never
    # sent): no write of it can land in the receiver's memory any more (its batches settled)
    "drained": {"tag": Text(256)},
    # driver-to-driver payload for the two-sided driver ``lane`` names ("": the chosen driver)
    "notice": {"payload": bytes, "lane": Text(64)},
    "ping": {"seq": Int()},
    "bye": {"reason": Text()},
}


#: Per message type, its text fields and their longest length (``encode`` cuts longer ones).
_TEXT_FIELDS: dict[str, tuple[tuple[str, int], ...]] = {
    kind: tuple((name, spec.max_len) for name, spec in schema.items() if isinstance(spec, Text))
    for kind, schema in SCHEMAS.items()
}


@dataclass(frozen=True)
class Message:
    type: str
    fields: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def encode(kind: str, limit: int | None = None, /, **fields: Any) -> bytes:
    """Pack a message, checking it against its schema (a bug here is ours, not the peer's) and
    against the size limit (``limit``, an endpoint's; ``None``: ``max_message_bytes()``)."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise ValueError(f"unknown message type {kind!r}")
    if fields.keys() != schema.keys():
        missing, extra = set(schema) - set(fields), set(fields) - set(schema)
        raise ValueError(f"{kind}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    _cut_texts(kind, fields)
    data = msgpack.packb({"v": PROTOCOL_VERSION, "t": kind, **fields}, use_bin_type=True)
    assert isinstance(data, bytes)
    return _within_limit(kind, data, limit)


def _cut_texts(kind: str, fields: dict[str, Any]) -> None:
    for name, max_len in _TEXT_FIELDS[kind]:
        value = fields[name]
        if isinstance(value, str) and len(value) > max_len:
            # Reasons quote peers and engines; cut them rather than fail to report the failure.
            fields[name] = value[: max_len - 3] + "..."


def _within_limit(kind: str, data: bytes, limit: int | None = None) -> bytes:
    limit = max_message_bytes() if limit is None else limit
    if len(data) > limit:
        raise MessageTooLarge(f"{kind} message of {len(data)} bytes exceeds the {limit}-byte limit")
    return data


class Done:
    """A "done" message packed in two steps: all but its notices when the transfer's batch is
    handed to the driver, the notices (and the size check) when the batch has finished, so
    that little is left to do between the engine's completion and the frame leaving. The bytes
    are those :func:`encode` gives for the same fields. ``limit``: the size limit (an
    endpoint's, read when it started; ``None``: ``max_message_bytes()`` at encode)."""

    __slots__ = ("_head", "lane", "limit")

    def __init__(self, tag: str, nbytes: int, lane: str, limit: int | None = None) -> None:
        self.lane = lane
        self.limit = limit
        fields: dict[str, Any] = {"tag": tag, "bytes": nbytes, "lane": lane}
        _cut_texts("done", fields)
        # In encode's order: v, t, tag, bytes, lane, notices. Only the tag and the count vary
        # from one transfer to the next; the rest is packed once (per lane), so that two packs
        # are left of what runs on the sender's thread before its batch reaches the engine.
        self._head = b"".join(
            (_DONE_START, _pack(fields["tag"]), _DONE_BYTES, _pack(nbytes), _done_tail(fields["lane"]))
        )

    def encode(self, notices: Sequence[bytes] = ()) -> bytes:
        n = len(notices)  # msgpack's array header: fixarray, array 16, array 32
        if n < 16:
            header = bytes((0x90 | n,))
        else:
            header = b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")
        packed = (msgpack.packb(p, use_bin_type=True) for p in notices)
        return _within_limit("done", b"".join((self._head, header, *packed)), self.limit)


def _pack(value: Any) -> bytes:
    data = msgpack.packb(value, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


_DONE_START = b"".join(
    (
        msgpack.Packer().pack_map_header(len(SCHEMAS["done"]) + 2),
        *map(_pack, ("v", PROTOCOL_VERSION, "t", "done", "tag")),
    )
)
_DONE_BYTES = _pack("bytes")


@functools.lru_cache(maxsize=64)  # this side's own driver names: a handful
def _done_tail(lane: str) -> bytes:
    return _pack("lane") + _pack(lane) + _pack("notices")


def decode(data: bytes, *, limit: int | None = None) -> Message:
    """Validate and unpack one message; :class:`ProtocolError` on anything malformed."""
    limit = max_message_bytes() if limit is None else limit
    if len(data) > limit:
        raise MessageTooLarge(f"message of {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise VersionMismatch(f"message protocol version {_short(version)}, expected {PROTOCOL_VERSION}")
    kind = obj.get("t")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {_short(kind)}")
    del obj["v"], obj["t"]
    fields = obj
    if fields.keys() != schema.keys():
        raise ProtocolError(f"{kind} message fields {_short(sorted(map(str, fields)))} do not match {sorted(schema)}")
    for name, spec in schema.items():
        _check_field(str(kind), name, spec, fields[name])
    return Message(str(kind), fields)


def _check_field(kind: str, name: str, spec: Field, value: Any) -> None:
    if isinstance(spec, Int):
        # bool is an int subclass in Python; a peer sending true for a count is malformed.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ProtocolError(f"{kind}.{name} must be an integer, got {type(value).__name__}")
        if not spec.lo <= value <= spec.hi:
            raise ProtocolError(f"{kind}.{name}={_short(value)} is outside [{spec.lo}, {spec.hi}]")
    elif isinstance(spec, Text):
        if not isinstance(value, str):
            raise ProtocolError(f"{kind}.{name} must be a string, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise ProtocolError(f"{kind}.{name} is {len(value)} characters long; at most {spec.max_len}")
    elif not isinstance(value, spec):
        raise ProtocolError(f"{kind}.{name} must be {spec.__name__}, got {type(value).__name__}")


#: A ``lanes`` map of a hello or welcome: at most this many entries, each info at most this long.
MAX_LANE_INFOS = 16
MAX_LANE_INFO_BYTES = 64 << 10


def read_lanes(kind: str, value: Any) -> dict[str, bytes]:
    """The ``lanes`` field of a hello or welcome, checked: driver names (at most 64
    characters) to connection infos (bytes, at most ``MAX_LANE_INFO_BYTES``)."""
    if not isinstance(value, dict) or len(value) > MAX_LANE_INFOS:
        raise ProtocolError(f"{kind}.lanes must be a map of at most {MAX_LANE_INFOS} entries")
    for name, info in value.items():
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise ProtocolError(f"{kind}.lanes has a key that is not a driver name: {_short(name)}")
        if not isinstance(info, bytes) or len(info) > MAX_LANE_INFO_BYTES:
            raise ProtocolError(f"{kind}.lanes[{name!r}] must be at most {MAX_LANE_INFO_BYTES} bytes")
    return dict(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 60, 60, 6, 6


def _short(value: Any, limit: int = 80) -> str:
    """A peer's value quoted in an error: bounded in depth and length (a thousand-deep list
    must not recurse through ``repr``)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
