"""Pacing: a large part goes to its lane's driver in slices, so that it cannot hold the lane.

An engine serves the requests of one connection in the order they reach it: a 512 MiB transfer
handed over as one batch holds every transfer after it on that connection until its last byte
moved (twenty 2 MiB requests behind one 512 MiB request took the whole 512 MiB's time, on every
driver: head-of-line blocking). So a part larger than the slice size
(:func:`slice_size`: what the lane moves in ``Limits.slice_ms`` at the rate it showed on this
connection, at least ``Limits.slice_bytes``) is cut into slices (:func:`cut`) and each
lane hands the driver at most ``Limits.slices_in_flight`` slices at a time (a slice holds
less than twice the slice size) (:class:`Pacer`);
a part of at most one slice goes to the driver at once, between them. The engine then holds a
small request behind at most that many slices, whatever the size of the large ones.

Among the transfers with slices waiting on a lane, the one with the fewest bytes left goes
first, aged: each second a transfer waits counts as :data:`AGING_BYTES_PER_S` bytes less, so
that a large transfer is never starved by a stream of medium ones. A transfer's own parts keep
their order: once one of its parts waits in slices, its later parts (small ones too) queue
behind it, and only its last slice carries "last" (so its "done" follows every byte).

The pacer only orders submissions: each slice is an ordinary batch of its transfer, and a
paced part's token (what ``Session.submit_part`` returns for it) stays pending until its last
slice finished (``Transfer.paced``: a layer-wise stream's ``settled`` waits for it). The
protocol counts a slice's bytes as any batch's; a failover sends the transfer's parts again,
whole, over the new lane, where they are sliced anew, and the old lane's queue of it is dropped. Any thread (the
caller's, under the transfer's plan lock, adds; the I/O thread, as batches finish, feeds).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtransport.spi.plan import Runs


def slice_size(floor: int, target_s: float, bytes_per_s: float) -> int:
    """The slice size of a lane that moves ``bytes_per_s`` (0: not measured yet): what it
    moves in ``target_s``, at least ``floor`` and at most ``MAX_SLICE_FACTOR`` times it; twice
    ``floor`` before a rate is known. A fast lane gets larger slices (each costs the same few
    hundred microseconds of handing over), a slow one smaller (a small request waits behind
    at most ``Limits.slices_in_flight`` of them)."""
    if not target_s:
        return floor
    if bytes_per_s <= 0:
        return 2 * floor
    return int(min(max(bytes_per_s * target_s, floor), MAX_SLICE_FACTOR * floor))


#: A slice is at most this many times ``Limits.slice_bytes``.
MAX_SLICE_FACTOR = 32
#: Each second a transfer's slices wait makes it count this many bytes smaller when the next
#: slice is picked (shortest remaining first, aged).
AGING_BYTES_PER_S = 1 << 30


def cut(runs: Runs, limit: int) -> list[Runs]:
    """``runs`` in order, as slices of less than twice ``limit`` bytes each: a run longer than
    ``limit`` is cut into pieces of ``limit`` bytes (and its rest), and consecutive runs
    starting within the same ``limit`` bytes of the part make a slice."""
    if limit <= 0 or runs.total_bytes <= limit:
        return [runs]
    src, dst, length = runs.src, runs.dst, runs.length
    long = length > limit
    if long.any():
        pieces = ((length + np.uint64(limit - 1)) // np.uint64(limit)).astype(np.int64)
        index = np.repeat(np.arange(len(length)), pieces)
        first = np.cumsum(pieces) - pieces  # each run's first piece
        offset = (np.arange(len(index), dtype=np.int64) - np.repeat(first, pieces)).astype(np.uint64)
        offset *= np.uint64(limit)
        src = src[index] + offset
        dst = dst[index] + offset
        length = np.minimum(length[index] - offset, np.uint64(limit))
    starts = np.cumsum(length, dtype=np.uint64) - length
    # A slice: the runs that start within one window of ``limit`` bytes of the part (each run
    # is at most ``limit`` long now, so a slice holds less than twice ``limit``).
    window = starts // np.uint64(limit)
    bounds = [0, *(np.flatnonzero(np.diff(window)) + 1).tolist(), len(length)]
    return [Runs(src[a:b], dst[a:b], length[a:b]) for a, b in itertools.pairwise(bounds)]


@dataclass(eq=False)
class _Waiting:
    """One transfer's slices waiting on a lane: each with the "last" flag it carries and the
    token of the part it belongs to."""

    transfer: object
    slices: collections.deque[tuple[Runs, bool, int]] = field(default_factory=collections.deque)
    nbytes: int = 0
    since: float = field(default_factory=lambda: time.monotonic())


#: Submits one slice of a transfer as the batch of the given id (0: a part without runs) on
#: the lane: whether it went to the lane's runner (not when the transfer ended or moved).
Submit = Callable[[object, Runs, bool, int], bool]
#: Whether a transfer's slices should still go on this lane (not final, not moved off it).
Live = Callable[[object], bool]
#: A part (its token) of a transfer has no slice waiting or in the driver any more.
PartDone = Callable[[object, int], None]


class Pacer:
    """One lane's slices: at most ``in_flight`` handed to its driver at a time.

    Taking a slice off the queue and handing it to the lane's runner is one step under the
    pacer's lock (the runner's queue takes it without blocking): one transfer's slices reach
    the driver in their order, and a caller that finds none of its transfer's slices waiting
    (``takes``) hands its next part to the runner behind all of them."""

    def __init__(
        self,
        submit: Submit,
        live: Live,
        new_batch_id: Callable[[], int],
        slice_bytes: Callable[[], int],
        in_flight: int,
        part_done: PartDone,
    ) -> None:
        self._submit = submit
        self._live = live
        self._new_batch_id = new_batch_id
        self._slice_bytes = slice_bytes
        self._max = max(1, in_flight)
        self._part_done = part_done
        self._lock = threading.Lock()
        self._waiting: dict[object, _Waiting] = {}
        #: Batch id -> (its transfer, its part's token), for the slices handed to the driver
        #: and not finished (entered before the submission: a batch can finish meanwhile).
        self._in_flight: dict[int, tuple[object, int]] = {}
        #: Part token -> (its transfer, its slices waiting or in the driver).
        self._parts: dict[int, tuple[object, int]] = {}

    def takes(self, transfer: object, nbytes: int) -> bool:
        """Whether a part of ``nbytes`` of ``transfer`` goes through the pacer: larger than a
        slice, or behind slices of the same transfer still waiting. (A part that does not is
        handed to the runner behind every slice of its transfer taken off the queue so far.)"""
        if nbytes > self._slice_bytes():
            return True
        with self._lock:
            return transfer in self._waiting

    def add(self, transfer: object, runs: Runs, last: bool, token: int) -> None:
        """Queue ``runs`` of ``transfer`` in slices (only its last slice carries ``last``),
        then hand the driver what the budget allows. ``token`` (a batch id no batch has)
        names the part: ``part_done(transfer, token)`` once no slice of it waits or is in the
        driver."""
        slices = cut(runs, self._slice_bytes())
        with self._lock:
            waiting = self._waiting.get(transfer)
            if waiting is None:
                waiting = self._waiting[transfer] = _Waiting(transfer)
            for i, piece in enumerate(slices):
                waiting.slices.append((piece, last and i == len(slices) - 1, token))
            waiting.nbytes += runs.total_bytes
            self._parts[token] = (transfer, len(slices))
        self.feed()

    def finished(self, bid: int) -> None:
        """Batch ``bid`` (perhaps not one of this pacer's) finished or failed."""
        with self._lock:
            entry = self._in_flight.pop(bid, None)
            if entry is None:
                return
            self._one_less(entry[1])
        self.feed()

    def forget(self, transfer: object) -> None:
        """``transfer`` ended or moved off this lane: none of its slices goes on it any more,
        and those handed over count no more (an abort reports none of them finished)."""
        with self._lock:
            known = self._drop(transfer)
        if known:
            self.feed()

    def _drop(self, transfer: object) -> bool:
        """Under the lock: every slice and part of ``transfer`` forgotten."""
        known = self._waiting.pop(transfer, None) is not None
        for bid in [b for b, (t, _) in self._in_flight.items() if t is transfer]:
            del self._in_flight[bid]
            known = True
        for token in [k for k, (t, _) in self._parts.items() if t is transfer]:
            del self._parts[token]
            self._part_done(transfer, token)
        return known

    def _one_less(self, token: int) -> None:
        entry = self._parts.get(token)
        if entry is None:
            return
        transfer, left = entry
        if left <= 1:
            del self._parts[token]
            self._part_done(transfer, token)
        else:
            self._parts[token] = (transfer, left - 1)

    def feed(self) -> None:
        """Hand the driver the next slices while fewer than the budget are in flight."""
        with self._lock:
            for t in {t for t, _ in self._in_flight.values()} | set(self._waiting):
                if not self._live(t):
                    self._drop(t)  # ended or moved: its batches count no more here
            while len(self._in_flight) < self._max and self._waiting:
                now = time.monotonic()
                waiting = min(self._waiting.values(), key=lambda w: w.nbytes - (now - w.since) * AGING_BYTES_PER_S)
                piece, last, token = waiting.slices.popleft()
                waiting.nbytes -= piece.total_bytes
                if not waiting.slices:
                    del self._waiting[waiting.transfer]
                if not len(piece):  # a part without runs (a last chunk with nothing to write)
                    self._one_less(token)
                    self._submit(waiting.transfer, piece, last, 0)
                    continue
                bid = self._new_batch_id()
                self._in_flight[bid] = (waiting.transfer, token)
                submitted = False
                try:
                    submitted = self._submit(waiting.transfer, piece, last, bid)
                finally:
                    if not submitted:
                        self._in_flight.pop(bid, None)
                        self._one_less(token)

    @property
    def waiting(self) -> int:
        """Slices waiting (for the metrics and tests)."""
        with self._lock:
            return sum(len(w.slices) for w in self._waiting.values())

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)
