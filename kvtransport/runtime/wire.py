"""Control messages: one typed, bounded schema per type, the version, the size limit, strict decoding.

Every message is a msgpack map ``{"t": <type>, "v": PROTOCOL_VERSION, ...fields}``. Each type is
a :class:`msgspec.Struct` below, the one place its fields are typed and bounded (the tables in
docs/wire.md are rendered from them). :func:`decode` checks the size, then decodes strictly
(exactly the fields of the type, no coercion: no string or float for an integer, no ``true``
for a count) and raises only :class:`~kvtransport.spi.errors.ProtocolError` (or a subclass) on
bad input, whatever the bytes, naming the field at fault. A message of another protocol version
is a :class:`~kvtransport.spi.errors.VersionMismatch`: the version is the whole of the protocol's
compatibility rule (the hello's too), so an unknown field is refused, never skipped.

Three fields carry documents with schemas of their own, checked one layer up so that a bad one
can be answered with its reason: the hello and regions of ``hello``/``welcome`` and the
``decision`` of ``welcome`` (:mod:`kvtransport.negotiation.schema`, docs/hello.md). ``expect``'s
``state`` entries are checked by the protocol (:func:`~kvtransport.runtime.checks.well_formed_state`):
a malformed one fails the transfer the message names, not the session.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Union

import msgspec
from msgspec import Meta, Struct

from kvtransport.negotiation.hello import PROTOCOL_VERSION
from kvtransport.negotiation.schema import schema_error
from kvtransport.spi.env import env_int
from kvtransport.spi.errors import MessageTooLarge, ProtocolError, VersionMismatch

#: Default largest control message (a hello with connection info is a few KiB; a destination
#: announcement for a 128k-token prompt is about 64 KiB).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
ENV_MAX_MESSAGE_BYTES = "KVTRANSPORT_MAX_MESSAGE_BYTES"

#: The largest integer any field may carry: everything the protocol counts (bytes, pages, slots)
#: fits in a signed 62-bit number, so no arithmetic on a checked value can overflow int64/uint64.
MAX_INT = (1 << 62) - 1
#: Most driver notices one "done" carries (the sender puts the notices of a one-batch transfer
#: in its "done" only when there are this many or fewer).
MAX_DONE_NOTICES = 8
#: Most entries of an announcement's ``state`` (each is checked by the protocol; an endpoint
#: registers at most ``spi.memory.MAX_STATE_GROUPS`` = 64 groups, so more fail the transfer).
MAX_STATE_ENTRIES = 1024


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


# --- field types ---------------------------------------------------------------------------------

Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
#: (never "~": a lane that comes back from quarantine gets a driver key "<conn>~<n>", runtime.failover)
ConnId = Annotated[str, Meta(max_length=64, pattern="^[^~]{0,64}$")]
Tag = Annotated[str, Meta(max_length=256)]
#: Driver name ("": the connection's chosen driver).
Lane = Annotated[str, Meta(max_length=64)]
#: Free text quoting peers and engines: :func:`encode` cuts a longer one rather than fail to
#: report a failure.
Reason = Annotated[str, Meta(max_length=4096)]
Nonce = Annotated[bytes, Meta(max_length=64)]
#: Packed arrays and driver payloads: bounded by the message size limit.
Blob = bytes
Document = dict[str, Any]


class Message(Struct, tag_field="t", kw_only=True, forbid_unknown_fields=True, gc=False):
    """A control message; subclasses are the types, their tag (``t``) the type's name."""

    #: The message type (the tag), set on each subclass below.
    type: ClassVar[str]
    #: Required on the wire (no default): a message without it is another protocol's.
    v: Annotated[int, Meta(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)]

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


# The authentication exchange, the only messages sent unsealed (auth.py, docs/security.md).
class AuthMsg(Message, tag="auth", kw_only=True):
    """initiator -> acceptor: a connection id and a fresh nonce"""

    conn: ConnId
    nonce: Nonce


class ChallengeMsg(Message, tag="challenge", kw_only=True):
    """acceptor -> initiator: the acceptor's fresh nonce"""

    conn: ConnId
    nonce: Nonce


class ProofMsg(Message, tag="proof", kw_only=True):
    """either side, initiator first: both nonces echoed, and an HMAC of the secret over the
    sender's role, the id and both nonces"""

    conn: ConnId
    nonce_i: Nonce
    nonce_a: Nonce
    mac: Nonce


#: A ``lanes`` map of a hello or welcome: at most this many entries, each info at most this long.
MAX_LANE_INFOS = 16
MAX_LANE_INFO_BYTES = 64 << 10
#: Driver name -> the connection info of the receive side that driver made for this connection
#: alone (``KVTransport.receive_info``), used instead of the hello's endpoint-wide one.
Lanes = Annotated[
    dict[Annotated[str, Meta(min_length=1, max_length=64)], Annotated[bytes, Meta(max_length=MAX_LANE_INFO_BYTES)]],
    Meta(max_length=MAX_LANE_INFOS),
]


class HelloMsg(Message, tag="hello", kw_only=True):
    """initiator -> acceptor: open a connection (``hello``, ``regions``: documents of their own
    schemas, docs/hello.md; ``lanes``: this side's receive sides for this connection)"""

    conn: ConnId
    hello: Document
    regions: Document
    lanes: Lanes


class WelcomeMsg(Message, tag="welcome", kw_only=True):
    """acceptor -> initiator: accepted, with the acceptor's hello and the decision it computed;
    ``express``: the acceptor's express port (0: none)"""

    conn: ConnId
    hello: Document
    regions: Document
    decision: Document
    express: Annotated[int, Meta(ge=0, le=65535)]
    lanes: Lanes


class ExpressMsg(Message, tag="express", kw_only=True):
    """initiator -> acceptor, the first frame on an express stream (express.py), sealed with the
    session's express key: binds the stream to connection ``conn``"""

    conn: ConnId


class RefuseMsg(Message, tag="refuse", kw_only=True):
    """acceptor -> initiator: refused, with the reason"""

    conn: ConnId
    reason: Reason


class ExpectMsg(Message, tag="expect", kw_only=True):
    """receiver -> sender: pages of transfer ``tag`` go to these destination pages (packed
    int64; aux -1: none); ``prefix``: how much of the sequence the receiver holds already (the
    application's unit; SGLang: decode_prefix_len tokens), so the sender sends only what follows;
    ``state``: per state group, the destination items (packed int64, empty: none) the last chunk
    fills (entries checked by the protocol: a bad one fails the transfer)"""

    tag: Tag
    pages: Blob
    aux: Annotated[int, Meta(ge=-1, le=MAX_INT)]
    prefix: Count
    state: Annotated[list[Any], Meta(max_length=MAX_STATE_ENTRIES)]


class DoneMsg(Message, tag="done", kw_only=True):
    """sender -> receiver: every byte of ``tag`` is in place, moved by the driver ``lane`` names
    (one of the connection's lanes; "": the chosen driver); ``notices``: payloads for that
    (two-sided) driver, each handled as a "notice" of ``lane`` before the "done" itself (the
    notices of a transfer whose one batch finished on the thread that sends its "done")"""

    tag: Tag
    bytes: Count
    lane: Lane
    notices: Annotated[list[Blob], Meta(max_length=MAX_DONE_NOTICES)]


class AbortMsg(Message, tag="abort", kw_only=True):
    """either side: the transfer failed or was aborted"""

    tag: Tag
    reason: Reason


class DrainedMsg(Message, tag="drained", kw_only=True):
    """sender -> receiver, after a failure or abort of ``tag`` (or an abort of a tag it never
    sent): no write of it can land in the receiver's memory any more (its batches settled)"""

    tag: Tag


class NoticeMsg(Message, tag="notice", kw_only=True):
    """driver-to-driver payload for the two-sided driver ``lane`` names ("": the chosen driver)"""

    payload: Blob
    lane: Lane


class LaneDownMsg(Message, tag="lane_down", kw_only=True):
    """sender -> receiver: the driver ``lane`` names failed for this connection (`reason`) in
    its generation ``gen`` (0 until it first came back from quarantine); its transfers go again
    over another lane, whose "done" counts only once the receiver fenced this one (no write of
    it can land any more); it is not used again until it comes back ("lane_reopen")"""

    lane: Lane
    gen: Count
    reason: Reason


class LaneReopenMsg(Message, tag="lane_reopen", kw_only=True):
    """either side, after its quarantine back-off: take the failed lane ``lane`` back in a new
    generation ``gen`` (above every one offered on this connection); ``info``: the receive
    side this side made for it (empty: its endpoint-wide one). The peer answers "lane_reopened"."""

    lane: Lane
    gen: Count
    info: Annotated[bytes, Meta(max_length=MAX_LANE_INFO_BYTES)]


class LaneReopenedMsg(Message, tag="lane_reopened", kw_only=True):
    """the answer to "lane_reopen": ``reason`` empty, the peer took the lane back in generation
    ``gen`` with its new receive side ``info`` (empty: its endpoint-wide one); else it did not,
    and why"""

    lane: Lane
    gen: Count
    info: Annotated[bytes, Meta(max_length=MAX_LANE_INFO_BYTES)]
    reason: Reason


class PingMsg(Message, tag="ping", kw_only=True):
    """either side, every heartbeat interval: still there"""

    seq: Count


class ByeMsg(Message, tag="bye", kw_only=True):
    """either side: the session ends, and why"""

    reason: Reason


#: Every message type by name, in the order docs/wire.md lists them.
TYPES: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        AuthMsg,
        ChallengeMsg,
        ProofMsg,
        HelloMsg,
        WelcomeMsg,
        ExpressMsg,
        RefuseMsg,
        ExpectMsg,
        DoneMsg,
        AbortMsg,
        DrainedMsg,
        NoticeMsg,
        LaneDownMsg,
        LaneReopenMsg,
        LaneReopenedMsg,
        PingMsg,
        ByeMsg,
    )
}
for _name, _cls in TYPES.items():
    _cls.type = _name

#: Per message type, its class and its reason fields (``encode`` cuts longer ones).
_ENCODING: dict[str, tuple[type[Message], tuple[str, ...]]] = {
    kind: (cls, tuple(f for f in cls.__struct_fields__ if f == "reason")) for kind, cls in TYPES.items()
}
_REASON_MAX = 4096

_ENCODER = msgspec.msgpack.Encoder()
#: One decoder for every type: msgspec reads the tag, then exactly that type's fields.
_DECODER: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Union[tuple(TYPES.values())])  # noqa: UP007 - a union built from the table


class _Envelope(Struct):
    """What a message that failed its schema is read as, to tell another version from a malformed one."""

    v: Any = None
    t: Any = None


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


def message(kind: str, /, **fields: Any) -> Message:
    """The message of type ``kind`` with these fields (not checked: what :func:`encode` sends
    and tests build; :func:`decode` is what checks)."""
    cls = TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown message type {kind!r}")
    try:
        return cls(v=PROTOCOL_VERSION, **fields)
    except TypeError:
        names = set(cls.__struct_fields__) - {"v"}
        missing, extra = names - set(fields), set(fields) - names
        raise ValueError(f"{kind}: missing {sorted(missing)}, unexpected {sorted(extra)}") from None


def encode(kind: str, limit: int | None = None, /, **fields: Any) -> bytes:
    """Pack a message (wrong fields are a ``ValueError``: a bug here is ours, not the peer's),
    checking it against the size limit (``limit``, an endpoint's; ``None``: ``max_message_bytes()``)."""
    try:
        cls, reasons = _ENCODING[kind]
        msg = cls(v=PROTOCOL_VERSION, **fields)
    except (KeyError, TypeError):
        message(kind, **fields)  # raises the ValueError that says what is wrong
        raise
    for name in reasons:
        value = getattr(msg, name)
        if isinstance(value, str) and len(value) > _REASON_MAX:
            # Reasons quote peers and engines; cut them rather than fail to report the failure.
            setattr(msg, name, value[: _REASON_MAX - 3] + "...")
    return _within_limit(kind, _ENCODER.encode(msg), limit)


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
        # ``notices`` is the last field: the message without notices ends with the one byte of
        # an empty array, and the rest is what varies.
        self._head = _ENCODER.encode(DoneMsg(v=PROTOCOL_VERSION, tag=tag, bytes=nbytes, lane=lane, notices=[]))[:-1]

    def encode(self, notices: Sequence[bytes] = ()) -> bytes:
        return _within_limit("done", self._head + _ENCODER.encode(notices), self.limit)


def decode(data: bytes, *, limit: int | None = None) -> Message:
    """Validate and unpack one message; :class:`ProtocolError` on anything malformed."""
    limit = max_message_bytes() if limit is None else limit
    if len(data) > limit:
        raise MessageTooLarge(f"message of {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        return _DECODER.decode(data)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes do to the decoder is the peer's
        raise _refusal(data, exc) from None


def _refusal(data: bytes, exc: Exception) -> ProtocolError:
    """The error for a message that failed its schema: another version's, or what is wrong."""
    if not isinstance(exc, msgspec.ValidationError):
        # Not msgpack, truncated, trailing bytes, nested past the recursion limit.
        return ProtocolError(f"undecodable message ({type(exc).__name__}: {str(exc)[:200]})")
    try:
        envelope = _ENVELOPE.decode(data)
    except Exception:  # noqa: BLE001 - not a map: the schema's own message says so
        return ProtocolError(schema_error(exc, "message"))
    version = envelope.v
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        return VersionMismatch(f"message protocol version {short(version)}, expected {PROTOCOL_VERSION}")
    kind = envelope.t
    if not isinstance(kind, str) or kind not in TYPES:
        return ProtocolError(f"unknown message type {short(kind)}")
    return ProtocolError(schema_error(exc, kind))


def short(value: Any, limit: int = 80) -> str:
    """A peer's value quoted in an error: bounded in length (what reaches here is a scalar or
    a shallow container from the envelope; ``repr`` of a deep one would recurse)."""
    text = repr(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
