"""The control port's connections that carry no session: bounded in number and in time.

zmq accepts every TCP connection to a ROUTER and says nothing of it to the application until a
message arrives, so a stranger who completes zmq's own greeting and then sends nothing held a
descriptor and about 23 KiB of this process per connection, for as long as it liked (measured:
5,000 such connections, 5,000 descriptors and 114 MiB; at a limit of 1,024 descriptors, no peer
could connect any more). This module watches the ROUTER's accepts and disconnects (zmq's socket
monitor). A connection is *claimed* once it carries a session
(:meth:`UnclaimedConnections.claim`, with the descriptor the accepted hello came in on); until
then it is unclaimed, and an unclaimed connection is closed when it has carried no session for
``timeout`` seconds, or, the oldest first, when more than ``most`` are open. A session that
ends gives its connection back to the unclaimed ones.

Connections are known by their addresses (local and peer), not by descriptor: the monitor's
events arrive late (a flood queues them), and by then zmq may have closed a descriptor and given
its number to another connection, while a pair of addresses names one live TCP connection. zmq
gives no call to close one peer's connection, so it is shut down through a duplicate of its
descriptor (the descriptor itself when the process has none left), after checking that it is
still the connection with those addresses; zmq then sees it end and releases it. I/O thread
only.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvtransport.runtime.timers import TimerHeap

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Monitor events read in one loop pass (the rest wait for the next one).
EVENTS_PER_PASS = 256
#: A connection whose disconnect was read while its descriptor still held it is looked at again
#: after this long, then after twice as long, up to RECHECK_LAST_S.
RECHECK_FIRST_S = 0.05
RECHECK_LAST_S = 1.6


@dataclass
class _Conn:
    fd: int
    timer: Any = None


class UnclaimedConnections:
    """Accepted control connections of one ROUTER, until each carries a session."""

    def __init__(self, router: zmq.Socket[bytes], port: int, timers: TimerHeap, *, timeout: float, most: int) -> None:
        self.monitor: zmq.Socket[bytes] = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._router = router
        #: The listening port: only connections to it are ever shut down.
        self._port = port
        self._timers = timers
        self._timeout = timeout
        self._most = most
        #: Unclaimed connections by their (local, peer) addresses, oldest first; claimed ones:
        #: addresses -> descriptor.
        self._unclaimed: collections.OrderedDict[Any, _Conn] = collections.OrderedDict()
        self._claimed: dict[Any, int] = {}
        #: Connections to look at again (:meth:`_recheck`), at most one timer each.
        self._rechecks: dict[Any, Any] = {}
        self._sweep_at = 64
        #: Connections closed for carrying no session (for the log's running count).
        self.closed_total = 0

    def __len__(self) -> int:
        return len(self._unclaimed)

    def on_events(self) -> None:
        """Read the monitor's accepts."""
        for _ in range(EVENTS_PER_PASS):
            try:
                raw = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(raw)
            except Exception:  # noqa: BLE001 - a malformed event is zmq's, not a peer's: skip it
                continue
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(int(event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected(int(event["value"]))

    def _accepted(self, fd: int) -> None:
        key = self._key_on(fd)
        if key is None:
            return  # closed already, or the number belongs to something else now
        if key in self._claimed or key in self._unclaimed:
            return  # a late event of a connection known already
        self._track(key, fd)

    def _disconnected(self, fd: int) -> None:
        """A connection on ``fd`` ended: forget what was known of it. zmq says so just before
        it closes the descriptor, so the number may still hold that connection when the event
        is read: then it is looked at again shortly (:meth:`_recheck`); a newer connection that
        holds the number by now is kept."""
        now_there = self._key_on(fd)
        for key, conn in list(self._unclaimed.items()):
            if conn.fd == fd and key != now_there:
                self._forget(key)
        for key, claimed_fd in list(self._claimed.items()):
            if claimed_fd == fd and key != now_there:
                self._forget(key)
        if now_there is not None and (now_there in self._unclaimed or now_there in self._claimed):
            self._recheck(fd, now_there, RECHECK_FIRST_S)

    def _recheck(self, fd: int, key: Any, delay: float) -> None:
        """Forget ``key`` once ``fd`` no longer holds it; look again after ``delay``, backing
        off, until :data:`RECHECK_LAST_S` (a connection still open then is alive, and is
        bounded as any other: the timeout if unclaimed, its session's end if claimed)."""
        if self._key_on(fd) != key:
            self._forget(key)
        elif delay <= RECHECK_LAST_S and key not in self._rechecks:
            self._rechecks[key] = self._timers.call_later(delay, functools.partial(self._recheck_due, fd, key, delay))

    def _recheck_due(self, fd: int, key: Any, delay: float) -> None:
        del self._rechecks[key]
        if key in self._unclaimed or key in self._claimed:
            self._recheck(fd, key, 2 * delay)

    def _forget(self, key: Any) -> None:
        conn = self._unclaimed.pop(key, None)
        if conn is not None:
            self._timers.cancel(conn.timer)
        self._claimed.pop(key, None)
        self._timers.cancel(self._rechecks.pop(key, None))

    def _track(self, key: Any, fd: int) -> None:
        conn = _Conn(fd)
        conn.timer = self._timers.call_later(self._timeout, functools.partial(self._expire, key, conn))
        self._unclaimed[key] = conn
        while len(self._unclaimed) > self._most:
            old_key, old = next(iter(self._unclaimed.items()))
            self._close(old_key, old, f"more than {self._most} control connections carry no session")

    def claim(self, fd: int) -> Any:
        """The connection on descriptor ``fd`` (the one a session's hello came in on) carries
        that session now: it stays open. What to give :meth:`release` when the session ends
        (``None``: nothing is known of that connection)."""
        key = self._key_on(fd)
        if key is None:
            return None
        conn = self._unclaimed.pop(key, None)
        if conn is not None:
            self._timers.cancel(conn.timer)
        self._claimed[key] = fd
        if len(self._claimed) > self._sweep_at:
            # Claims whose connections went without a release (their number reused meanwhile).
            for claimed, claimed_fd in list(self._claimed.items()):
                if self._key_on(claimed_fd) != claimed:
                    del self._claimed[claimed]
            self._sweep_at = max(64, 2 * len(self._claimed))
        return key

    def release(self, fd: int, key: Any) -> None:
        """The session that :meth:`claim` gave ``key`` for ended: its connection, if it is still
        the one on ``fd`` (its number may belong to a newer connection by now, another
        session's), is unclaimed again, from now."""
        if self._claimed.get(key) != fd:
            return
        del self._claimed[key]
        if self._key_on(fd) == key and key not in self._unclaimed:
            self._track(key, fd)

    def _expire(self, key: Any, conn: _Conn) -> None:
        if self._unclaimed.get(key) is conn:
            self._close(key, conn, f"a control connection carried no session for {self._timeout:g} s")

    def _close(self, key: Any, conn: _Conn, why: str) -> None:
        del self._unclaimed[key]
        self._timers.cancel(conn.timer)
        if key not in self._claimed:
            self._timers.cancel(self._rechecks.pop(key, None))
        if key not in self._claimed and _shut_down_if(conn.fd, key):
            self.closed_total += 1
            log.debug("closed the control connection from %s: %s", _describe(key[1]), why)
            if self.closed_total in (1, 10, 100, 1000) or self.closed_total % 10000 == 0:
                log.warning("kvtransport: closed %d control connections so far (%s)", self.closed_total, why)

    def _key_on(self, fd: int) -> Any:
        """``(local, peer)`` addresses of the TCP connection on ``fd`` if it is one to this
        ROUTER's port (``None`` otherwise, or when it is closed)."""
        key = _with_socket(fd, _names)
        if key is None or not isinstance(key[0], tuple) or key[0][1] != self._port:
            return None
        return key

    def close(self) -> None:
        # Read what the monitor queued first: zmq's own thread may be blocked sending it an
        # event (a full pipe) while holding the lock that disabling the monitor takes.
        with contextlib.suppress(zmq.ZMQError):
            while True:
                self.monitor.recv(zmq.NOBLOCK)
        with contextlib.suppress(zmq.ZMQError):
            self._router.disable_monitor()
        self.monitor.close(0)
        self._unclaimed.clear()
        self._claimed.clear()
        self._rechecks.clear()


def _names(sock: socket.socket) -> tuple[Any, Any]:
    return sock.getsockname(), sock.getpeername()


def _with_socket(fd: int, use: Callable[[socket.socket], T]) -> T | None:
    """``use`` applied to the socket on descriptor ``fd`` (``None`` when it is no socket, or
    ``use`` raised ``OSError``). Through a duplicate descriptor, so that what ``use`` does
    concerns one connection even if zmq closes ``fd`` and reuses its number meanwhile; without
    one when the process is out of descriptors (exactly when strangers must be closed)."""
    try:
        dup = os.dup(fd)
    except OSError:
        dup = -1
    try:
        sock = socket.socket(fileno=dup if dup >= 0 else fd)
    except OSError:
        if dup >= 0:
            os.close(dup)
        return None  # not a socket (a file or a pipe took the number), or closed
    try:
        return use(sock)
    except OSError:
        return None
    finally:
        if dup >= 0:
            sock.close()
        else:
            sock.detach()  # the descriptor is zmq's: not closed here


def _shut_down_if(fd: int, key: Any) -> bool:
    """Shut the connection on ``fd`` down if its addresses are ``key``; whether it did."""

    def check_and_shut(sock: socket.socket) -> bool:
        if _names(sock) != key:
            return False  # zmq closed it and the number now belongs to another connection
        sock.shutdown(socket.SHUT_RDWR)
        return True

    return bool(_with_socket(fd, check_and_shut))


def _describe(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
