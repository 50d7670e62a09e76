"""Receive sides made ahead and released behind a connection's handshake.

A driver that gives each peer a receive side of its own (``receives_per_peer``: an engine or
agent with this endpoint's memory registered) pays for one at every handshake: a NIXL agent
takes 30-50 ms to make here, and closing a Mooncake engine took 0.9 s holding the interpreter
lock (every other thread of the process stalled as long; the driver now shuts its listeners
first, which makes it 1 ms, but a side made for nothing is still a cost).
:class:`Spares` keeps ``keep`` of them ready, made on a thread of its own, so that
``receive_info`` hands one out at once; a side nobody wrote into (another driver was chosen, a
connection that never announced pages) comes back to it instead of being closed (up to
``hold``); closing happens on that thread too. Bounded: at most ``hold`` ready, at most
``MAX_CLOSING`` waiting to be closed (past it a side is closed on the caller's thread).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Sides waiting for the spares' thread to close them; past it ``release`` closes on the spot.
MAX_CLOSING = 64
#: After a failure to make a side, the thread waits this long before it tries again.
RETRY_S = 5.0


class Spares(Generic[T]):
    """``keep`` receive sides ready (made by ``make`` on a thread of its own), handed out by
    :meth:`take`; :meth:`give_back` keeps an unused one, :meth:`release` closes one (``close``)
    on that thread. :meth:`stop` ends the thread and closes everything still held."""

    def __init__(
        self, name: str, make: Callable[[], T], close: Callable[[T], None], keep: int = 1, hold: int = 4
    ) -> None:
        self._name, self._make, self._close, self._keep, self._hold = name, make, close, keep, hold
        self._ready: collections.deque[T] = collections.deque()
        self._closing: collections.deque[T] = collections.deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def take(self) -> T:
        """A ready side, or one made now if none is (the thread makes the next)."""
        with self._cv:
            side = self._ready.popleft() if self._ready else None
            self._start()
            self._cv.notify()
        return self._make() if side is None else side

    def give_back(self, side: T) -> None:
        """``side`` was handed out but nobody ever wrote into it: kept for a later connection
        (up to ``hold`` ready: the thread makes sides up to ``keep``, but closing one can stall
        the process for a second, so unused ones are kept rather than closed), else closed."""
        with self._cv:
            if not self._stopped and len(self._ready) < self._hold:
                self._ready.append(side)
                return
        self.release(side)

    def release(self, side: T) -> None:
        """Close ``side`` on the spares' thread (at once here, past ``MAX_CLOSING`` or after
        :meth:`stop`)."""
        with self._cv:
            if not self._stopped and len(self._closing) < MAX_CLOSING:
                self._closing.append(side)
                self._start()
                self._cv.notify()
                return
        self._close_quietly([side])

    def stop(self, extra: Iterable[T] = ()) -> None:
        """End the thread; close every side still held and ``extra``, in parallel (closing one
        can take a second)."""
        with self._cv:
            self._stopped = True
            held = [*self._ready, *self._closing, *extra]
            self._ready.clear()
            self._closing.clear()
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10.0)
        closers = [threading.Thread(target=self._close_quietly, args=([s],), daemon=True) for s in held]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=10.0)

    def _start(self) -> None:
        """Lock held: the thread, started on first use."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name=f"{self._name}-spares", daemon=True)
            self._thread.start()

    def _close_quietly(self, sides: list[T]) -> None:
        for side in sides:
            try:
                self._close(side)
            except Exception:
                log.exception("%s: closing a receive side failed", self._name)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self._closing and len(self._ready) >= self._keep:
                    self._cv.wait()
                if self._stopped:
                    return
                closing = list(self._closing)
                self._closing.clear()
                want = len(self._ready) < self._keep
            self._close_quietly(closing)
            if not want:
                continue
            try:
                side = self._make()
            except Exception as exc:  # noqa: BLE001 - take() makes its own meanwhile
                log.warning(
                    "%s: making a spare receive side failed (%s); trying again in %.0f s", self._name, exc, RETRY_S
                )
                with self._cv:
                    self._cv.wait(RETRY_S)
                continue
            with self._cv:
                if self._stopped:
                    keep = False
                else:
                    self._ready.append(side)
                    keep = True
            if not keep:
                self._close_quietly([side])
