"""Which destination bytes a peer may write into here right now: the pages announced to it.

A one-sided driver's writes are checked by the sender against the pages the receiver announced.
A two-sided driver (the staged path) writes on the receiver's behalf from what the peer's notices
say, so the receiver checks every piece itself: it must lie inside pages (or the aux slot, or
state items) that a live receive transfer of *that* connection announced (its :class:`Claim`).
:class:`InboundGuard` keeps a count per page, per aux slot and per item of each state group,
raised when a transfer announces and lowered when it finishes.

A transfer that *failed* (aborted, timed out) may still have chunks on the wire that left the
sender before it learnt of the failure. Its pages are *revoked* for a while rather than
forgotten: a chunk that lands only on live or revoked pages of that peer is late, not hostile,
and :meth:`InboundGuard.check` answers ``False`` (drop it, write nothing); a chunk that touches a
page nobody of that peer announced is refused with :class:`InvalidPages`.

Threads: the I/O thread adds and removes; the driver thread checks. Counts are numpy arrays
updated in place, so a check sees either state of a concurrent change; a piece that races a
transfer's end is refused, which is the safe answer.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtransport.spi.errors import InvalidPages
from kvtransport.spi.memory import RegionSet

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
#: Addresses, lengths or offsets of pieces: a list for a few pieces (a small chunk's notice is
#: decoded so: numpy's calls, cheap in a loop, cost 7-30 us each on a core whose caches went
#: cold between requests, a list's handling a few), else an array.
Pieces = U64 | list[int]


def as_list(p: Pieces) -> list[int]:
    return p if isinstance(p, list) else p.tolist()


def as_u64(p: Pieces) -> U64:
    return p if isinstance(p, np.ndarray) else np.array(p, dtype=np.uint64)


#: Chunks of at most this many pieces are checked piece by piece in plain Python: the vectorised
#: check is about twenty numpy calls whatever the count (30-60 us for the two pieces of a
#: one-page chunk, several times that on the receiver's cold core in the middle of a request),
#: plain Python a few microseconds for a few pieces.
FEW_PIECES = 8
#: ... and a piece of at most this many pages (or slots, items) is looked up item by item.
SHORT_SPAN = 16

_NONE: I64 = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Claim:
    """What one receive transfer announced: KV pages, an aux slot (-1: none) and, per state
    group, the state items (window pages, slots) it expects."""

    pages: I64
    aux: int = -1
    state: tuple[I64, ...] = ()

    def spaces(self) -> list[I64]:
        """Indices per index space: KV pages, aux slots, then each state group's items."""
        aux = np.array([self.aux], dtype=np.int64) if self.aux >= 0 else _NONE
        return [self.pages, aux, *self.state]


class InboundGuard:
    def __init__(self, regions: RegionSet) -> None:
        # Index spaces: 0 the KV pages, 1 the aux slots, 2 + g the items of state group g.
        tagged = [(r, 0) for r in regions.kv] + [(r, 1) for r in regions.aux]
        for g in range(len(regions.state_groups)):
            tagged += [(r, 2 + g) for r in regions.state_group(g)]
        ordered = sorted(tagged, key=lambda x: x[0].ptr)
        self._starts = np.array([r.ptr for r, _ in ordered], dtype=np.uint64)
        self._ends = np.array([r.end for r, _ in ordered], dtype=np.uint64)
        self._items = np.array([r.item_len for r, _ in ordered], dtype=np.uint64)
        self._spaces = np.array([k for _, k in ordered], dtype=np.int16)
        # The same as Python lists, for the piece-by-piece check (Python ints cannot overflow).
        self._start_list = [r.ptr for r, _ in ordered]
        self._end_list = [r.end for r, _ in ordered]
        self._item_list = [r.item_len for r, _ in ordered]
        self._space_list = [k for _, k in ordered]
        sizes = [regions.num_pages, min((r.num_items for r in regions.aux), default=0)]
        sizes += [regions.state_slots(g) for g in range(len(regions.state_groups))]
        self._names = ["page", "aux slot"] + [f"item of state group {g}" for g in range(len(regions.state_groups))]
        self._live = [np.zeros(n, dtype=np.int32) for n in sizes]
        self._revoked = [np.zeros(n, dtype=np.int32) for n in sizes]

    # -- I/O thread ------------------------------------------------------------------------

    def _count(self, counts: list[npt.NDArray[np.int32]], claim: Claim, delta: int) -> None:
        # The indices of one announcement are unique per space (checked before).
        for space, indices in enumerate(claim.spaces()):
            if indices.size:
                counts[space][indices] += delta

    def add(self, claim: Claim) -> None:
        self._count(self._live, claim, +1)

    def remove(self, claim: Claim) -> None:
        self._count(self._live, claim, -1)

    def revoke(self, claim: Claim) -> None:
        """A transfer failed: what it claimed is no longer writable, but late chunks for it
        are recognised (dropped quietly) until :meth:`forget_revoked`."""
        self.remove(claim)
        self._count(self._revoked, claim, +1)

    def forget_revoked(self, claim: Claim) -> None:
        self._count(self._revoked, claim, -1)

    # -- driver thread ---------------------------------------------------------------------

    def check(self, dst: Pieces, length: Pieces, what: str) -> bool:
        """``True``: every ``[dst, dst+length)`` lies inside one region and covers only pages,
        aux slots and state items currently announced. ``False``: some pieces land on what a
        transfer of this peer that failed recently announced (late data: write none of it).
        Raises :class:`InvalidPages` for anything else."""
        if len(dst) != len(length):
            raise InvalidPages(f"{what}: {len(dst)} destinations for {len(length)} lengths")
        if len(dst) == 0:
            return True
        if len(dst) <= FEW_PIECES:
            return self._check_few(as_list(dst), as_list(length), what)
        return self._check_many(as_u64(dst), as_u64(length), what)

    def _check_few(self, dst: list[int], length: list[int], what: str) -> bool:
        """:meth:`check` for a few pieces, in plain Python, with the same answers and errors as
        the vectorised :meth:`_check_many` (the tests hold the two to one model). Plain loops,
        no comprehensions: each of those is a function call of its own, and on a core whose
        caches went cold between requests every call counts."""
        # (Negative: only from a caller that skipped the uint64 range. Addresses outside it and
        # lengths past it fail the region rules below, as in the vectorised check.)
        if min(length) <= 0:
            raise InvalidPages(f"{what}: a piece of zero bytes" if 0 in length else f"{what}: a negative length")
        starts, ends, items, spaces = self._start_list, self._end_list, self._item_list, self._space_list
        # Rule by rule over every piece, as the vectorised check, so both raise the same error.
        at: list[int] = []
        for d in dst:
            at.append(bisect.bisect_right(starts, d) - 1)
        if min(at) < 0:
            raise InvalidPages(f"{what}: a piece starts below every registered region")
        pieces: list[tuple[int, int, int]] = []
        for d, n, i in zip(dst, length, at, strict=True):
            if d + n > ends[i]:
                raise InvalidPages(f"{what}: a piece reaches outside the registered region it starts in")
            base, item = starts[i], items[i]
            pieces.append((spaces[i], (d - base) // item, (d + n - 1 - base) // item))
        # One index space (KV pages only: the usual chunk) or several, in order.
        order = sorted(set(map(operator.itemgetter(0), pieces))) if len(pieces) > 1 else [pieces[0][0]]
        live = True
        for space in order:
            counts, revoked, name = self._live[space], self._revoked[space], self._names[space]
            size = counts.size
            for s, _, hi in pieces:
                if s == space and hi >= size:
                    raise InvalidPages(f"{what}: a piece reaches past the last {name}")
            for s, lo, hi in pieces:
                if s != space:
                    continue
                # Element by element for a short span (a numpy slice and reduction cost tens of
                # microseconds on a cold core, an ``item`` a few).
                if hi - lo < SHORT_SPAN:
                    for i in range(lo, hi + 1):
                        if counts.item(i) <= 0:
                            break
                    else:
                        continue
                elif bool((counts[lo : hi + 1] > 0).all()):
                    continue
                live = False
                if not bool(((counts[lo : hi + 1] > 0) | (revoked[lo : hi + 1] > 0)).all()):
                    raise InvalidPages(f"{what}: {name}s {lo}..{hi} were not announced by a transfer of this peer")
        return live

    def _check_many(self, dst: U64, length: U64, what: str) -> bool:
        if np.any(length == 0):
            raise InvalidPages(f"{what}: a piece of zero bytes")
        slot = np.searchsorted(self._starts, dst, side="right").astype(np.int64) - 1
        if np.any(slot < 0):
            raise InvalidPages(f"{what}: a piece starts below every registered region")
        end = self._ends[slot]
        if np.any(dst > end) or np.any(length > end - np.minimum(dst, end)):
            raise InvalidPages(f"{what}: a piece reaches outside the registered region it starts in")
        spaces = self._spaces[slot]
        first = ((dst - self._starts[slot]) // self._items[slot]).astype(np.int64)
        last = ((dst + length - np.uint64(1) - self._starts[slot]) // self._items[slot]).astype(np.int64)
        live = True
        for space in np.unique(spaces).tolist():
            counts, revoked, name = self._live[space], self._revoked[space], self._names[space]
            mask = spaces == space
            lo, hi = first[mask], last[mask]
            if np.any(hi >= counts.size):
                raise InvalidPages(f"{what}: a piece reaches past the last {name}")
            if not _covered(counts, lo, hi).all():
                live = False
                known = _covered(counts, lo, hi, revoked)
                bad = np.flatnonzero(~known)
                if bad.size:
                    k = int(bad[0])
                    raise InvalidPages(
                        f"{what}: {name}s {int(lo[k])}..{int(hi[k])} were not announced by a transfer of this peer"
                    )
        return live


def _covered(
    counts: npt.NDArray[np.int32], lo: I64, hi: I64, also: npt.NDArray[np.int32] | None = None
) -> npt.NDArray[np.bool_]:
    """For each piece, whether every index in ``[lo, hi]`` has a positive count (in ``counts``,
    or in ``also``). Looks only at the indices the pieces span, never the whole table: this runs
    for every inbound chunk, and a serving pool has 10^5-10^6 pages."""
    if np.array_equal(lo, hi):  # every piece within one page (or item): look them up
        hit: npt.NDArray[np.bool_] = counts[lo] > 0
        return hit if also is None else hit | (also[lo] > 0)
    base, top = int(lo.min()), int(hi.max()) + 1
    flags = counts[base:top] > 0
    if also is not None:
        flags |= also[base:top] > 0
    prefix = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    result: npt.NDArray[np.bool_] = prefix[hi - base + 1] - prefix[lo - base] == hi - lo + 1
    return result
