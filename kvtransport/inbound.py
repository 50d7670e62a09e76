"""Which destination bytes a peer may write into here right now: the pages announced to it.

A one-sided driver's writes are checked by the sender against the pages the receiver announced.
A two-sided driver (the staged path) writes on the receiver's behalf from what the peer's notices
say, so the receiver checks every piece itself: it must lie inside pages (or the aux slot) that
a live receive transfer of *that* connection announced. :class:`InboundGuard` keeps a count per
page and per aux slot, raised when a transfer announces and lowered when it finishes.

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

import numpy as np
import numpy.typing as npt

from .errors import InvalidPages
from .memory import RegionSet

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

_KV, _AUX, _OTHER = 0, 1, 2


class InboundGuard:
    def __init__(self, regions: RegionSet) -> None:
        ordered = sorted(
            [(r, _KV) for r in regions.kv] + [(r, _AUX) for r in regions.aux] + [(r, _OTHER) for r in regions.state],
            key=lambda x: x[0].ptr,
        )
        self._starts = np.array([r.ptr for r, _ in ordered], dtype=np.uint64)
        self._ends = np.array([r.end for r, _ in ordered], dtype=np.uint64)
        self._items = np.array([r.item_len for r, _ in ordered], dtype=np.uint64)
        self._kinds = np.array([k for _, k in ordered], dtype=np.int8)
        self._pages = np.zeros(regions.num_pages, dtype=np.int32)
        self._aux = np.zeros(min((r.num_items for r in regions.aux), default=0), dtype=np.int32)
        self._revoked_pages = np.zeros_like(self._pages)
        self._revoked_aux = np.zeros_like(self._aux)

    # -- I/O thread ------------------------------------------------------------------------

    def add(self, pages: I64, aux: int) -> None:
        self._pages[pages] += 1  # pages of one announcement are unique (checked before)
        if aux >= 0:
            self._aux[aux] += 1

    def remove(self, pages: I64, aux: int) -> None:
        self._pages[pages] -= 1
        if aux >= 0:
            self._aux[aux] -= 1

    def revoke(self, pages: I64, aux: int) -> None:
        """A transfer failed: its pages are no longer writable, but late chunks for them are
        recognised (dropped quietly) until :meth:`forget_revoked`."""
        self.remove(pages, aux)
        self._revoked_pages[pages] += 1
        if aux >= 0:
            self._revoked_aux[aux] += 1

    def forget_revoked(self, pages: I64, aux: int) -> None:
        self._revoked_pages[pages] -= 1
        if aux >= 0:
            self._revoked_aux[aux] -= 1

    # -- driver thread ---------------------------------------------------------------------

    def check(self, dst: U64, length: U64, what: str) -> bool:
        """``True``: every ``[dst, dst+length)`` lies inside one region and covers only pages /
        aux slots currently announced. ``False``: some pieces land on pages of a transfer of
        this peer that failed recently (late data: write none of it). Raises
        :class:`InvalidPages` for anything else."""
        if dst.size == 0:
            return True
        if np.any(length == 0):
            raise InvalidPages(f"{what}: a piece of zero bytes")
        slot = np.searchsorted(self._starts, dst, side="right").astype(np.int64) - 1
        if np.any(slot < 0):
            raise InvalidPages(f"{what}: a piece starts below every registered region")
        end = self._ends[slot]
        if np.any(dst > end) or np.any(length > end - np.minimum(dst, end)):
            raise InvalidPages(f"{what}: a piece reaches outside the registered region it starts in")
        kinds = self._kinds[slot]
        if np.any(kinds == _OTHER):
            raise InvalidPages(f"{what}: a piece lands in a state region, which staged transfers never write")
        first = ((dst - self._starts[slot]) // self._items[slot]).astype(np.int64)
        last = ((dst + length - np.uint64(1) - self._starts[slot]) // self._items[slot]).astype(np.int64)
        live = True
        for kind, counts, revoked, name in (
            (_KV, self._pages, self._revoked_pages, "page"),
            (_AUX, self._aux, self._revoked_aux, "aux slot"),
        ):
            mask = kinds == kind
            if not mask.any():
                continue
            lo, hi = first[mask], last[mask]
            if np.any(hi >= counts.size):
                raise InvalidPages(f"{what}: a piece reaches past the last {name}")
            if not _covered(counts > 0, lo, hi).all():
                live = False
                known = _covered((counts > 0) | (revoked > 0), lo, hi)
                bad = np.flatnonzero(~known)
                if bad.size:
                    k = int(bad[0])
                    raise InvalidPages(
                        f"{what}: {name}s {int(lo[k])}..{int(hi[k])} were not announced by a transfer of this peer"
                    )
        return live


def _covered(flags: npt.NDArray[np.bool_], lo: I64, hi: I64) -> npt.NDArray[np.bool_]:
    """For each piece, whether every index in ``[lo, hi]`` is flagged."""
    prefix = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    result: npt.NDArray[np.bool_] = prefix[hi + 1] - prefix[lo] == hi - lo + 1
    return result
