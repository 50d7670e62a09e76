"""The staged path's notices (carried in control ``notice`` messages), with a typed schema.

Sender -> receiver: ``want`` (n more slots), ``release`` (slots it will not use), ``chunk``
(slot s holds these pieces for these destinations). Receiver -> sender: ``grant`` (slots it
asked for), ``lend`` (slots it did not ask for yet, lent ahead of a transfer just announced, to
be used or released within ``hold_ms``), ``revoke`` (granted slots it held unused too long while
another peer waits: give back those not yet taken for a write).
:func:`decode_notice` checks every field's type and range before anything uses it, and raises
only :class:`~kvtransport.spi.errors.ProtocolError`; integers arrive bounded, so no arithmetic on
them can overflow.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from kvtransport.spi.errors import ProtocolError
from kvtransport.spi.inbound import FEW_PIECES
from kvtransport.staging.config import MAX_SLOTS
from kvtransport.staging.copy import Pieces

#: Most pieces in one chunk notice (a chunk of 8 MiB of 1 KiB pages is 8,192).
MAX_PIECES = 1 << 16
#: Longest a lent slot may be held unused, in milliseconds (a lend naming more is refused).
MAX_HOLD_MS = 10_000


@dataclass(frozen=True)
class Want:
    n: int


@dataclass(frozen=True)
class Grant:
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Lend:
    slots: tuple[int, ...]
    hold_ms: int


@dataclass(frozen=True)
class Release:
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Revoke:
    slots: tuple[int, ...]


@dataclass(frozen=True)
class ChunkNotice:
    """Lists for a chunk of at most ``FEW_PIECES`` pieces, arrays for more."""

    slot: int
    dst: Pieces
    length: Pieces
    offset: Pieces


Notice = Want | Grant | Lend | Release | Revoke | ChunkNotice


def encode_want(n: int) -> bytes:
    return _pack({"op": "want", "n": int(n)})


def encode_grant(slots: list[int]) -> bytes:
    return _pack({"op": "grant", "slots": [int(s) for s in slots]})


def encode_lend(slots: list[int], hold_ms: int) -> bytes:
    return _pack({"op": "lend", "slots": [int(s) for s in slots], "hold_ms": int(hold_ms)})


def encode_release(slots: list[int]) -> bytes:
    return _pack({"op": "release", "slots": [int(s) for s in slots]})


def encode_revoke(slots: list[int]) -> bytes:
    return _pack({"op": "revoke", "slots": [int(s) for s in slots]})


def encode_chunk(slot: int, dst: Pieces, length: Pieces, offset: Pieces) -> bytes:
    return _pack(
        {"op": "chunk", "slot": int(slot), "dst": _packed(dst), "len": _packed(length), "off": _packed(offset)}
    )


def _packed(p: Pieces) -> bytes:
    """Native uint64s, as ``decode_notice`` reads them (both ends run on one architecture)."""
    if isinstance(p, list):
        return struct.pack(f"={len(p)}Q", *p)
    return p.astype(np.uint64, copy=False).tobytes()


def _pack(doc: dict[str, Any]) -> bytes:
    data = msgpack.packb(doc, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def decode_notice(payload: Any, slots: int) -> Notice:
    """Validate a notice from a peer whose rings have ``slots`` slots each way."""
    if not isinstance(payload, bytes):
        raise ProtocolError("staging notice must be bytes")
    try:
        msg = msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise ProtocolError(f"undecodable staging notice: {type(exc).__name__}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError("staging notice must be a map")
    op = msg.get("op")
    if op == "want":
        _fields(msg, "n")
        return Want(_int(msg["n"], "want.n", 1, MAX_SLOTS))
    if op in ("grant", "release", "revoke"):
        _fields(msg, "slots")
        numbers = _slots(msg, op, slots)
        return Grant(numbers) if op == "grant" else Release(numbers) if op == "release" else Revoke(numbers)
    if op == "lend":
        _fields(msg, "slots", "hold_ms")
        return Lend(_slots(msg, op, slots), _int(msg["hold_ms"], "lend.hold_ms", 0, MAX_HOLD_MS))
    if op == "chunk":
        _fields(msg, "slot", "dst", "len", "off")
        slot = _int(msg["slot"], "chunk.slot", 0, slots - 1)
        fields: list[Pieces] = []
        for key in ("dst", "len", "off"):
            raw = msg[key]
            if not isinstance(raw, bytes) or len(raw) % 8 or not 0 < len(raw) <= 8 * MAX_PIECES:
                raise ProtocolError(f"chunk.{key} must be 1..{MAX_PIECES} packed uint64")
            # A few pieces (a small request's chunk) as plain ints: what handles them next is
            # cheaper on lists than numpy's per-call cost; many as one array.
            fields.append(
                memoryview(raw).cast("Q").tolist() if len(raw) <= 8 * FEW_PIECES else np.frombuffer(raw, np.uint64)
            )
        dst, length, offset = fields
        if not len(dst) == len(length) == len(offset):
            raise ProtocolError("chunk piece lists of different lengths")
        return ChunkNotice(slot, dst, length, offset)
    raise ProtocolError(f"unknown staging notice {str(op)[:32]!r}")


def _slots(msg: dict[str, Any], op: str, slots: int) -> tuple[int, ...]:
    raw = msg["slots"]
    if not isinstance(raw, list) or len(raw) > MAX_SLOTS:
        raise ProtocolError(f"{op}.slots must be a list of at most {MAX_SLOTS} slot numbers")
    return tuple(_int(s, f"{op}.slots[]", 0, slots - 1) for s in raw)


@functools.lru_cache(maxsize=8)  # one entry per kind of notice
def _field_set(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(("op", *names))


def _fields(msg: dict[str, Any], *names: str) -> None:
    if msg.keys() != _field_set(names):
        raise ProtocolError(f"staging notice {str(msg.get('op'))[:32]} must have exactly the fields {sorted(names)}")


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}], got {str(value)[:32]}")
    return value
