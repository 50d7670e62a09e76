"""The two seams of the staged path: the copy engine (KV memory <-> host ring) and the wire link
(this ring -> the peer's ring)."""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvtransport.spi.inbound import U64, Pieces, as_list, as_u64

__all__ = ["U64", "CopyEngine", "MemcpyCopyEngine", "Pieces", "WireLink", "as_list", "as_u64", "shifted"]


def shifted(base: int, offsets: Pieces) -> Pieces:
    """``base + offsets``, of the same kind as ``offsets``."""
    if isinstance(offsets, list):
        return [base + o for o in offsets]
    return np.uint64(base) + offsets


class CopyEngine(Protocol):
    """Copies pieces between KV memory and the host ring; ``copy`` returns when every byte is
    in place (for device copies: when the stream's work has completed). No piece's
    destination overlaps another piece's source (KV memory to ring, or ring to KV memory), so
    the pieces may be copied in any order or together. ``dst``, ``src`` and ``length`` are
    uint64 arrays, or lists of ints for a chunk of at most ``FEW_PIECES`` pieces (``as_u64``
    makes arrays of them)."""

    name: str
    #: ``copy`` may be called from any thread, briefly (the pipeline then copies small chunks
    #: on the thread that submits or receives them); ``False`` keeps every copy on the
    #: pipeline's own stage threads (an engine with per-thread state, such as CUDA streams).
    any_thread: bool

    def copy(self, dst: Pieces, src: Pieces, length: Pieces) -> None: ...

    def close(self) -> None: ...


#: Pieces of one strided group (equal lengths, constant steps on both sides) copied as one
#: 2-D copy from this many on: a head slice of every token row is thousands of short pieces
#: (unequal TP), which one ``memmove`` call each would spend in the interpreter.
STRIDED_MIN = 4
#: Pieces of one length copied as rows of one indexed copy from this many on (one call into
#: numpy's loop for all of them, whatever their addresses): 8 MiB of 1 KiB head slices takes
#: 3 ms against 18 ms as 2-D copies of one page's 16 rows each (measured, this host class).
ROWS_MIN = 16
#: Only pieces up to this long are copied as rows, and a copy whose pieces are all longer looks
#: for no strided groups either: from 32 KiB on (a whole page of one layer, Llama-3-8B) one
#: ``memmove`` each costs less than the indexed copy, which also copies the source rows into a
#: temporary first when they are scattered (2 MiB of 32 KiB pages gathered into a ring chunk:
#: 170 us as rows, 94 us one ``memmove`` each; measured, this host class).
ROWS_MAX_LEN = 16 << 10
#: The largest address span one indexed copy views (the pieces of one length may lie in
#: several regions; the view is never touched outside them, but it must be addressable).
ROWS_MAX_SPAN = 1 << 44


class MemcpyCopyEngine:
    """Host memory to host memory. Fewer than ``STRIDED_MIN`` pieces: one ``memmove`` each.
    Otherwise pieces adjacent on both sides are merged first; if every merged piece is longer
    than ``ROWS_MAX_LEN``, one ``memmove`` each; else the pieces of a length (up to
    ``ROWS_MAX_LEN``) shared by many are copied as rows of one indexed numpy copy, the rest by
    one 2-D numpy copy per strided group, or one ``memmove`` per piece (the GIL is released
    during each copy)."""

    name = "memcpy"
    any_thread = True

    def copy(self, dst: Pieces, src: Pieces, length: Pieces) -> None:
        if len(length) < STRIDED_MIN or isinstance(length, list):
            # A small chunk's few pieces (lists come only for at most ``FEW_PIECES``): merging
            # them would cost more numpy calls than the one ``memmove`` each it could save.
            _memmove_each(dst, src, length)
            return
        dst, src, length = coalesce(as_u64(dst), as_u64(src), as_u64(length))
        if int(length.min()) > ROWS_MAX_LEN:
            # Long pieces (whole pages): a call each costs little beside its copy, and looking
            # for rows or strided groups would cost more than it could save.
            _memmove_each(dst, src, length)
            return
        if len(length) >= ROWS_MIN:
            rest = _copy_row_sets(dst, src, length)
            if rest is not None:
                dst, src, length = dst[rest], src[rest], length[rest]
        if len(length) < STRIDED_MIN:
            _memmove_each(dst, src, length)
            return
        start = 0
        for first, count in strided_groups(dst, src, length):
            if first > start:
                _memmove_each(dst[start:first], src[start:first], length[start:first])
            _copy_2d(int(dst[first]), int(src[first]), int(length[first]), count, dst, src, first)
            start = first + count
        if start < len(length):
            _memmove_each(dst[start:], src[start:], length[start:])

    def close(self) -> None:
        return None


def coalesce(dst: U64, src: U64, length: U64) -> tuple[U64, U64, U64]:
    """The same copy with each series of pieces that follow one another on both sides (a page
    slice's token rows gathered into a ring chunk) as one piece."""
    if len(length) < 2:
        return dst, src, length
    join = (dst[:-1] + length[:-1] == dst[1:]) & (src[:-1] + length[:-1] == src[1:])
    if not join.any():
        return dst, src, length
    starts = np.flatnonzero(np.concatenate(([True], ~join)))
    return dst[starts], src[starts], np.add.reduceat(length, starts).astype(np.uint64)


def _copy_row_sets(dst: U64, src: U64, length: U64) -> npt.NDArray[np.bool_] | None:
    """Copy each set of at least :data:`ROWS_MIN` pieces of one length whose addresses line up
    on that length (on each side) as rows of one indexed copy; the mask of the pieces left,
    or ``None`` if none was copied."""
    lengths, counts = np.unique(length, return_counts=True)
    rest = None
    for n, count in zip(lengths.tolist(), counts.tolist(), strict=True):
        if count < ROWS_MIN or n == 0 or n > ROWS_MAX_LEN:
            continue
        sel = length == n
        d, s = dst[sel], src[sel]
        d0, s0 = int(d.min()), int(s.min())
        span_d, span_s = int(d.max()) - d0 + n, int(s.max()) - s0 + n
        if max(span_d, span_s) > ROWS_MAX_SPAN or ((d - d0) % n).any() or ((s - s0) % n).any():
            continue
        _copy_rows(d0, (d - d0) // np.uint64(n), s0, (s - s0) // np.uint64(n), n, span_d, span_s)
        rest = ~sel if rest is None else rest & ~sel
    return rest


def _copy_rows(d0: int, drow: U64, s0: int, srow: U64, n: int, span_d: int, span_s: int) -> None:
    row = np.dtype((np.void, n))
    out = _rows(d0, span_d, row)
    inp = _rows(s0, span_s, row)
    di, si = drow.astype(np.intp), srow.astype(np.intp)
    if _back_to_back(si):
        out[di] = inp[int(si[0]) : int(si[0]) + len(si)]  # the source rows back to back (a ring chunk)
    else:  # (np.take into a ring chunk measured slower than this, temporary copy and all)
        out[di] = inp[si]


def _back_to_back(rows: npt.NDArray[np.intp]) -> bool:
    return len(rows) > 1 and int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool((np.diff(rows) == 1).all())


def _rows(addr: int, span: int, row: np.dtype[Any]) -> np.ndarray[Any, np.dtype[Any]]:
    return np.frombuffer(memoryview((ctypes.c_uint8 * span).from_address(addr)).cast("B"), dtype=row)


def _memmove_each(dst: Pieces, src: Pieces, length: Pieces) -> None:
    for d, s, n in zip(as_list(dst), as_list(src), as_list(length), strict=True):
        ctypes.memmove(d, s, n)


def strided_groups(dst: U64, src: U64, length: U64) -> list[tuple[int, int]]:
    """``(first piece, count)`` of each group of at least :data:`STRIDED_MIN` consecutive
    pieces with one length and constant, non-overlapping forward steps on both sides; groups
    do not share pieces."""
    n = len(length)
    if n < STRIDED_MIN:
        return []
    d, s, ln = dst.astype(np.int64), src.astype(np.int64), length.astype(np.int64)
    dd, sd = np.diff(d), np.diff(s)
    # Step j joins pieces j and j+1: usable when both have one length and it moves forward by
    # at least that length on both sides; it continues step j-1's group when it is the same.
    good = (ln[1:] == ln[:-1]) & (dd >= ln[:-1]) & (sd >= ln[:-1])
    cont = np.zeros(n - 1, dtype=bool)
    cont[1:] = good[1:] & good[:-1] & (dd[1:] == dd[:-1]) & (sd[1:] == sd[:-1])
    starts = np.flatnonzero(good & ~cont)
    stops = np.flatnonzero(~cont)  # a group's steps end before the next step that does not continue it
    # The piece a group ends on: the step that does not continue it, or the last piece.
    ends = np.append(stops, n - 1)[np.searchsorted(stops, starts, side="right")]
    groups, free = [], 0
    for a, e in zip(starts.tolist(), ends.tolist(), strict=True):
        first = max(a, free)  # its first piece may be the previous group's last
        count = e - first + 1  # pieces first .. e (steps first .. e-1)
        if count >= STRIDED_MIN:
            groups.append((first, count))
            free = e + 1
    return groups


def _copy_2d(d0: int, s0: int, n: int, count: int, dst: U64, src: U64, first: int) -> None:
    dstep = int(dst[first + 1]) - d0
    sstep = int(src[first + 1]) - s0
    out = _strided(d0, dstep, n, count)
    out[...] = _strided(s0, sstep, n, count)


def _strided(addr: int, step: int, n: int, count: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    span = step * (count - 1) + n
    flat: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(
        memoryview((ctypes.c_uint8 * span).from_address(addr)).cast("B"), dtype=np.uint8
    )
    return np.lib.stride_tricks.as_strided(flat, shape=(count, n), strides=(step, 1))


class WireLink(Protocol):
    """How a host driver moves one chunk to one peer: ``post`` starts writing ``length`` bytes
    from this ring to the peer's ring and returns a token; ``check`` says whether it is there
    (raises if it failed). Neither may block for the transfer."""

    def post(self, local: int, remote: int, length: int) -> Any: ...

    def check(self, token: Any) -> bool: ...
