"""Timers of the I/O thread: a heap of deadlines, so the loop sleeps exactly until the next one.

Timeouts, heartbeats and retention each schedule a :class:`Timer`; the loop asks
:meth:`TimerHeap.next_delay` how long it may block and runs what is due with :meth:`run_due`.
Cancelling is lazy (a flag), and the heap is rebuilt without cancelled entries once they are the
majority, so it never holds more than about twice the live timers. Single-threaded: only the
I/O thread changes a heap; ``len()`` may be read from any thread (one counter, never a
difference of two fields read at different moments).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Timer:
    __slots__ = ("callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class TimerHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._cancelled = 0
        self._live = 0

    def __len__(self) -> int:
        """Live (not cancelled, not fired) timers."""
        return self._live

    def call_at(self, deadline: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(deadline, callback)
        heapq.heappush(self._heap, (deadline, next(self._seq), timer))
        self._live += 1
        return timer

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.call_at(time.monotonic() + delay, callback)

    def cancel(self, timer: Timer | None) -> None:
        if timer is not None and not timer.cancelled:
            timer.cancel()
            self._live -= 1
            self._cancelled += 1
            if self._cancelled > 64 and self._cancelled * 2 > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].cancelled]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def next_delay(self, now: float) -> float | None:
        """Seconds until the next live timer (0 if one is due), ``None`` if there is none."""
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
            self._cancelled -= 1
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - now)

    def run_due(self, now: float, budget: int = 1024) -> None:
        """Run up to ``budget`` due timers; one that raises is logged and does not stop the rest."""
        for _ in range(budget):
            if not self._heap or self._heap[0][0] > now:
                return
            _, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                self._cancelled -= 1
                continue
            timer.cancelled = True  # fired: a later cancel() must not count it again
            self._live -= 1
            try:
                timer.callback()
            except Exception:
                log.exception("kvtransport timer callback failed")
