"""Control messages: schema, version, size limit and strict validation on decode.

Every message is a msgpack map ``{"v": PROTOCOL_VERSION, "t": <type>, ...fields}``. Each type
has a schema (field -> expected Python type); :func:`decode` checks size, framing, version,
type and every field before anything else sees the message, and raises only
:class:`~kvtransport.errors.ProtocolError` (or a subclass) on bad input, whatever the bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import MessageTooLarge, ProtocolError, VersionMismatch
from .hello import PROTOCOL_VERSION

#: Default largest control message (a hello with connection info is a few KiB; a destination
#: announcement for a 128k-token prompt is about 64 KiB).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


def max_message_bytes() -> int:
    raw = os.environ.get("KVTRANSPORT_MAX_MESSAGE_BYTES", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_MAX_MESSAGE_BYTES


# Message types and their fields. ``bytes`` fields carry packed int64 page arrays or driver
# payloads; ``dict`` fields carry documents validated by their own parsers (hello, regions).
SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    # initiator -> acceptor: open a connection
    "hello": {"conn": str, "hello": dict, "regions": dict},
    # acceptor -> initiator: accepted, with the acceptor's hello and the decision it computed
    "welcome": {"conn": str, "hello": dict, "regions": dict, "decision": dict},
    # acceptor -> initiator: refused, with the reason
    "refuse": {"conn": str, "reason": str},
    # receiver -> sender: pages of transfer ``tag`` go to these destination pages
    "expect": {"tag": str, "pages": bytes, "aux": int},
    # sender -> receiver: every byte of ``tag`` is in place
    "done": {"tag": str, "bytes": int},
    # either side: the transfer failed or was aborted
    "abort": {"tag": str, "reason": str},
    # driver-to-driver payload for two-sided drivers
    "notice": {"payload": bytes},
    "ping": {"seq": int},
    "bye": {"reason": str},
}


@dataclass(frozen=True)
class Message:
    type: str
    fields: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def encode(kind: str, **fields: Any) -> bytes:
    """Pack a message, checking it against its schema (a bug here is ours, not the peer's)."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise ValueError(f"unknown message type {kind!r}")
    missing = set(schema) - set(fields)
    extra = set(fields) - set(schema)
    if missing or extra:
        raise ValueError(f"{kind}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    data = msgpack.packb({"v": PROTOCOL_VERSION, "t": kind, **fields}, use_bin_type=True)
    assert isinstance(data, bytes)
    limit = max_message_bytes()
    if len(data) > limit:
        raise MessageTooLarge(f"{kind} message of {len(data)} bytes exceeds the {limit}-byte limit")
    return data


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
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"message protocol version {version!r}, expected {PROTOCOL_VERSION}")
    kind = obj.get("t")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    fields = {k: v for k, v in obj.items() if k not in ("v", "t")}
    if set(fields) != set(schema):
        raise ProtocolError(f"{kind} message fields {sorted(map(str, fields))} do not match {sorted(schema)}")
    for name, expected in schema.items():
        value = fields[name]
        # bool is an int subclass in Python; a peer sending true for a count is malformed.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ProtocolError(f"{kind}.{name} must be {_type_name(expected)}, got {type(value).__name__}")
    return Message(str(kind), fields)


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__
