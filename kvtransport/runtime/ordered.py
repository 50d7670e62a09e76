"""Ordered mode: one session's ordered messages on its express stream, in the order they were sent.

A two-sided session (one whose drivers send notices that must reach the peer before the "done"
of their chunks) whose express stream bound before it sent any ordered message switches to
ordered mode: from then on every message of ``ORDERED_KINDS`` and every driver notice goes on
that stream, from whichever thread sends it, and never on the control channel, so the peer reads
them in the order they were sent. :class:`OrderedStream` owns that switch, the writes, and the
per-thread holding that lets the notices of a one-batch transfer ride in its "done".
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvtransport.runtime.wire import MAX_DONE_NOTICES, Done, encode
from kvtransport.spi.errors import MessageTooLarge

if TYPE_CHECKING:
    from kvtransport.runtime.express_link import ExpressLink


class OrderedOwner(Protocol):
    """What ordered mode needs of its session."""

    id: str

    @property
    def closing(self) -> bool: ...
    @property
    def two_sided(self) -> bool: ...
    @property
    def max_message_bytes(self) -> int: ...
    def post(self, fn: Callable[[], None]) -> None:
        """Any thread: queue ``fn`` for the I/O thread."""

    def notices_queued_for(self, peer: str) -> bool: ...
    def express_lost(self, link: ExpressLink, why: str) -> None: ...


class OrderedStream:
    """One session's ordered mode (module docstring)."""

    def __init__(self, owner: OrderedOwner) -> None:
        self._owner = owner
        #: The stream every ordered message goes on, once in ordered mode. Set once, on the I/O
        #: thread, under ``lock``; never unset.
        self.link: ExpressLink | None = None
        self.lock = threading.Lock()
        #: Per thread: ordered messages held back to go out in one write (``hold``).
        self._held = threading.local()
        #: Whether an ordered message already went out on the control channel (the session can
        #: then no longer switch: one of those could be overtaken by the stream).
        self.sent_on_control = False

    def take(self, link: ExpressLink) -> bool:
        """I/O thread, when ``link`` bound: a two-sided session that has sent no ordered message
        on the control channel yet (nor queued a driver notice for it) sends all of them on
        ``link`` from now on. Decided once: a session that already used the control channel
        for them stays on it (its stream then carries "done" of nothing)."""
        owner = self._owner
        with self.lock:
            if (
                self.link is None
                and owner.two_sided
                and not self.sent_on_control
                and not owner.notices_queued_for(owner.id)
            ):
                self.link = link
        return self.link is link

    def send(self, data: bytes) -> bool:
        """Any thread, ordered mode: ``data`` on the express stream. A message that cannot go
        out whole there cannot go anywhere else either (a later one could overtake it): the
        session ends, with :class:`~kvtransport.spi.errors.PeerLost`, and everything it held
        fails; nothing is left waiting for a message that was never sent."""
        held: list[tuple[str | None, bytes]] | None = getattr(self._held, "items", None)
        if held is not None:
            held.append((None, data))
            return True
        return self._write((data,))

    def hold(self) -> None:
        """Ordered mode: this thread's ordered messages and driver notices of this session
        wait for :meth:`release`. Held only by the thread that submits a one-batch transfer and
        may see it finish (``runtime.driver_side``): the chunk notices the driver sends from
        inside ``submit`` then ride in that transfer's "done" (one message, one write, read by
        the peer in one wake-up) instead of going out one frame each. Nothing can need to
        overtake them meanwhile: the transfer's "done" and "drained" come from this thread (or
        after the runner's claim that this thread holds), and every other message of the
        session is about other transfers or ring slots, whose order against these does not
        matter."""
        if getattr(self._held, "items", None) is None:
            self._held.items = []

    def hold_notice(self, lane: str, payload: bytes) -> bool:
        """A driver notice for ``lane``: held, if this thread holds (see :meth:`hold`)."""
        held: list[tuple[str | None, bytes]] | None = getattr(self._held, "items", None)
        if held is None:
            return False
        held.append((lane, payload))
        return True

    def release(self, done: Done | None = None) -> bool:
        """Stop holding; send what this thread held, and ``done`` behind it, in one write. The
        held notices ride in that "done" when they are all its lane's and fit in one message.
        Whether it all went out (what a lone :meth:`send` answers)."""
        items: list[tuple[str | None, bytes]] = getattr(self._held, "items", None) or []
        self._held.items = None
        frames: list[bytes] = []
        if done is not None and 0 < len(items) <= MAX_DONE_NOTICES and set(map(_FIRST, items)) == {done.lane}:
            try:
                frames = [done.encode(list(map(_SECOND, items)))]
            except MessageTooLarge:
                pass  # one frame each, then
        if not frames:
            limit = self._owner.max_message_bytes
            frames = [
                data if lane is None else encode("notice", limit, payload=data, lane=lane) for lane, data in items
            ]
            if done is not None:
                frames.append(done.encode())
        return self._write(frames) if frames else True

    def _write(self, frames: Sequence[bytes]) -> bool:
        link = self.link
        assert link is not None
        # Never waits for room: what does not fit waits in the stream's backlog (express.py).
        if link.send_many(frames, queue=True):
            return True
        owner = self._owner
        if not owner.closing:
            owner.post(functools.partial(owner.express_lost, link, "a message could not be written to it"))
        return False


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
