"""The staged path's notices (carried in control ``notice`` messages), with a typed schema.

Sender -> receiver: ``want`` (n more slots), ``release`` (slots it will not use), ``chunk``
(slot s holds these pieces for these destinations). Receiver -> sender: ``grant`` (slots it
asked for), ``lend`` (slots it did not ask for yet, lent ahead of a transfer just announced, to
be used or released within ``hold_ms``), ``revoke`` (granted slots it held unused too long while
another peer waits: give back those not yet taken for a write).
Each kind is a :class:`msgspec.Struct` below, the one place its fields are typed and bounded
(docs/wire.md renders them). :func:`decode_notice` decodes strictly (exactly the kind's fields, no
coercion) and checks slot numbers against the ring before anything uses them, and raises only
:class:`~kvtransport.spi.errors.ProtocolError`; integers arrive bounded, so no arithmetic on them
can overflow.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Union

import msgspec
import numpy as np
from msgspec import Meta, Struct

from kvtransport.negotiation.schema import schema_error
from kvtransport.spi.errors import ProtocolError
from kvtransport.spi.inbound import FEW_PIECES
from kvtransport.staging.config import MAX_SLOTS
from kvtransport.staging.copy import Pieces

#: Most pieces in one chunk notice (a chunk of 8 MiB of 1 KiB pages is 8,192).
MAX_PIECES = 1 << 16
#: Longest a lent slot may be held unused, in milliseconds (a lend naming more is refused).
MAX_HOLD_MS = 10_000

#: A slot number of any ring (:func:`decode_notice` checks it against the peer's).
Slot = Annotated[int, Meta(ge=0, le=MAX_SLOTS - 1)]
Slots = Annotated[tuple[Slot, ...], Meta(max_length=MAX_SLOTS)]
#: Packed native uint64s, one per piece.
PieceArray = Annotated[bytes, Meta(min_length=8, max_length=8 * MAX_PIECES)]


class StagingNotice(Struct, tag_field="op", forbid_unknown_fields=True, frozen=True, gc=False):
    """A notice; its ``op`` (the tag) is its kind."""


class Want(StagingNotice, tag="want", frozen=True):
    """sender -> receiver: ``n`` more slots, please"""

    n: Annotated[int, Meta(ge=1, le=MAX_SLOTS)]


class Grant(StagingNotice, tag="grant", frozen=True):
    """receiver -> sender: slots it asked for"""

    slots: Slots


class Lend(StagingNotice, tag="lend", frozen=True):
    """receiver -> sender: slots it did not ask for yet, to be used or released within ``hold_ms``"""

    slots: Slots
    hold_ms: Annotated[int, Meta(ge=0, le=MAX_HOLD_MS)]


class Release(StagingNotice, tag="release", frozen=True):
    """sender -> receiver: slots it will not use"""

    slots: Slots


class Revoke(StagingNotice, tag="revoke", frozen=True):
    """receiver -> sender: granted slots held unused too long: give back those not yet taken"""

    slots: Slots


class Chunk(StagingNotice, tag="chunk", frozen=True):
    """sender -> receiver: ``slot`` holds these pieces (equal numbers of each) for these
    destinations"""

    slot: Slot
    dst: PieceArray
    length: PieceArray = msgspec.field(name="len")
    offset: PieceArray = msgspec.field(name="off")

    def __post_init__(self) -> None:
        if len(self.dst) % 8 or len(self.length) % 8 or len(self.offset) % 8:
            raise ValueError("piece lists must be packed uint64 (a multiple of 8 bytes)")
        if not len(self.dst) == len(self.length) == len(self.offset):
            raise ValueError("chunk piece lists of different lengths")


#: Every kind, in the order docs/wire.md lists them.
KINDS: tuple[type[StagingNotice], ...] = (Want, Grant, Lend, Release, Revoke, Chunk)


class ChunkNotice(Struct, frozen=True, gc=False):
    """A chunk notice as its receiver uses it: lists for a chunk of at most ``FEW_PIECES``
    pieces, arrays for more. (A Struct for its cheap construction: never decoded as one.)"""

    slot: int
    dst: Pieces
    length: Pieces
    offset: Pieces


Notice = Want | Grant | Lend | Release | Revoke | ChunkNotice

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[StagingNotice] = msgspec.msgpack.Decoder(Union[KINDS])  # noqa: UP007 - a union built from the table


class _Op(Struct):
    op: Any = None


def encode_want(n: int) -> bytes:
    return _ENCODER.encode(Want(int(n)))


def encode_grant(slots: list[int]) -> bytes:
    return _ENCODER.encode(Grant(tuple(map(int, slots))))


def encode_lend(slots: list[int], hold_ms: int) -> bytes:
    return _ENCODER.encode(Lend(tuple(map(int, slots)), int(hold_ms)))


def encode_release(slots: list[int]) -> bytes:
    return _ENCODER.encode(Release(tuple(map(int, slots))))


def encode_revoke(slots: list[int]) -> bytes:
    return _ENCODER.encode(Revoke(tuple(map(int, slots))))


def encode_chunk(slot: int, dst: Pieces, length: Pieces, offset: Pieces) -> bytes:
    return _ENCODER.encode(Chunk(int(slot), _packed(dst), _packed(length), _packed(offset)))


def _packed(p: Pieces) -> bytes:
    """Native uint64s, as ``decode_notice`` reads them (both ends run on one architecture)."""
    if isinstance(p, list):
        return struct.pack(f"={len(p)}Q", *p)
    return p.astype(np.uint64, copy=False).tobytes()


def decode_notice(payload: Any, slots: int) -> Notice:
    """Validate a notice from a peer whose rings have ``slots`` slots each way."""
    if not isinstance(payload, bytes):
        raise ProtocolError("staging notice must be bytes")
    try:
        notice = _DECODER.decode(payload)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes do to the decoder is the peer's
        raise _refusal(payload, exc) from None
    if isinstance(notice, Chunk):
        if notice.slot >= slots:
            raise ProtocolError(f"chunk.slot {notice.slot} is outside the ring's [0, {slots - 1}]")
        # A few pieces (a small request's chunk) as plain ints: what handles them next is
        # cheaper on lists than numpy's per-call cost; many as one array.
        if len(notice.dst) <= 8 * FEW_PIECES:
            return ChunkNotice(
                notice.slot,
                memoryview(notice.dst).cast("Q").tolist(),
                memoryview(notice.length).cast("Q").tolist(),
                memoryview(notice.offset).cast("Q").tolist(),
            )
        return ChunkNotice(
            notice.slot,
            np.frombuffer(notice.dst, np.uint64),
            np.frombuffer(notice.length, np.uint64),
            np.frombuffer(notice.offset, np.uint64),
        )
    assert isinstance(notice, Want | Grant | Lend | Release | Revoke)  # the decoder's union
    if slots < MAX_SLOTS and not isinstance(notice, Want) and any(s >= slots for s in notice.slots):
        op = notice.__struct_config__.tag
        raise ProtocolError(f"{op}.slots names a slot outside the ring's [0, {slots - 1}]")
    return notice


def _refusal(payload: bytes, exc: Exception) -> ProtocolError:
    if not isinstance(exc, msgspec.ValidationError):
        return ProtocolError(f"undecodable staging notice: {type(exc).__name__}")
    try:
        op = _OP.decode(payload).op
    except Exception:  # noqa: BLE001 - not a map: the schema's own message says so
        return ProtocolError(schema_error(exc, "staging notice"))
    if op not in _OPS:
        return ProtocolError(f"unknown staging notice {(op if isinstance(op, str) else type(op).__name__)[:32]!r}")
    return ProtocolError(schema_error(exc, str(op)))


_OP = msgspec.msgpack.Decoder(_Op)
_OPS = frozenset(k.__struct_config__.tag for k in KINDS)
