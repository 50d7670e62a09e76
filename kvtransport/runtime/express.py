"""The express stream: one plain TCP connection per session, beside the zmq control channel,
for the messages a waiting request is blocked on: "done", and on a two-sided session everything
that must arrive before it.

Why it exists: on a small host one zmq message between Python threads of two processes takes
0.22-0.26 ms (three wake-ups: zmq's I/O thread on each side, then the receiving thread), and
the sending I/O thread costs one more wake-up before it can send; over a plain socket the same
hop is 13-20 us (one wake-up, the reader's). For a 64 KiB request that was most of its time
(docs/performance.md, "Small requests"). So the thread that sees a transfer's only batch
finish (the caller's, the driver's runner, or the engine's signalling thread) seals "done" and
writes it to the stream itself, and the peer's I/O thread, which waits on the stream's
descriptor in the same poll as its zmq sockets, handles it like any other message.

What it carries: on a one-sided session, only "done" (after the binding frame), which needs no
order against the control channel: it follows the announcement (the receiver's own earlier
message), and it goes express only for a transfer whose one batch finished. The control channel
carries every such "done" as well (the session's I/O thread sends it, as before): a stream that
breaks, or never opened, costs latency and nothing else.

A two-sided session (a staged driver: its chunks' notices must reach the peer before the "done"
behind them) uses the stream in *ordered mode* instead, if it binds before the session sent any
of those messages on the control channel: from then on every announcement, notice, "done",
abort and "drained" of that session goes on the stream, and none on the control channel, so
the peer reads them in the order they were written, by whichever thread wrote them (the staged
wire thread writes a chunk's notice and its transfer's "done" the moment the write finishes).
No thread waits for room in the socket: what does not fit joins the stream's backlog, which
the I/O thread writes out as the peer reads (it watches the socket for room). A writer that
waited instead held whichever thread it was on (the I/O thread, a runner or a staging stage,
each shared by every peer) for as long as one peer read nothing: a member that stopped reading
its stream cost every other peer its heartbeats. A backlog larger than the stream's limit, or
one the peer took nothing of for the heartbeat timeout, fails the stream. A stream of an
ordered session that breaks, or fails so, ends the session with ``PeerLost``: a message may
have been lost, and none may overtake it.

Security: frames are sealed like the control channel's (:class:`~kvtransport.runtime.auth.Seal`) with
keys of their own, derived from the same handshake. The first frame binds the stream to its
session: the connection id in clear, then a sealed "express" message naming it, which only a
holder of that session's keys can produce. A stranger who connects is closed at its first bad
frame or after the connect timeout, and unbound streams are capped (the oldest goes first). A
frame that fails authentication closes the stream; the session goes on over the control channel
(in ordered mode it ends).

Threads: the I/O thread accepts, dials, binds, reads, writes backlogs out and closes; any
thread may write a sealed frame to a bound stream (one at a time, under the stream's lock).

This module is the port (``ExpressPort``): the listener peers dial, the streams being dialled
and those accepted but not bound yet (capped, each for at most the connect timeout), binding a
stream to its session, reading the bound ones and handing their messages to the endpoint,
writing their backlogs out as the peer reads, and what it needs of the endpoint and of a session
(``StreamOwner``, ``StreamSession``). The stream itself, its framing and one bound stream
(``ExpressLink``), is :mod:`kvtransport.runtime.express_link`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from kvtransport.runtime.auth import RateLimitedLog, Seal
from kvtransport.runtime.control import WILDCARDS, address_host
from kvtransport.runtime.express_link import (
    BACKLOG_FRAMES,
    LENGTH,
    MAX_FRAME_BYTES,
    ORDERED_KINDS,
    READ_BYTES,
    ExpressLink,
    FrameReader,
    bound_frame_bytes,
)
from kvtransport.runtime.wire import decode
from kvtransport.spi.errors import ChannelDown, ProtocolError

if TYPE_CHECKING:
    from kvtransport.runtime.config import Limits, Timeouts
    from kvtransport.runtime.control import ControlChannel, Route
    from kvtransport.runtime.wire import Message

log = logging.getLogger(__name__)

#: Reads of one stream in one loop pass: after handling what a read brought, the stream is read
#: again (up to this many times) if that read found it drained, since more may have come during
#: the handling: a chunk's notice is followed by its transfer's "done" within a fraction of the
#: time handling the notice takes, and the next loop pass would cost 0.1-0.2 ms more (a poll
#: over every socket, the timers, the queued calls) before "done" is read. A read that filled
#: ``READ_BYTES`` (a flood) ends the stream's turn.
READS_PER_PASS = 4
#: Connections accepted in one loop pass.
ACCEPTS_PER_PASS = 16
#: How long the listener rests after accept() failed for want of descriptors.
ACCEPT_BACKOFF_S = 0.5
_MAX_CONN_ID = 64


class _Unbound:
    """An accepted stream that has not bound itself to a session yet."""

    __slots__ = ("reader", "sock", "timer")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.timer: Any = None


class StreamSession(Protocol):
    """What the port needs of a session (``runtime.session.Session``): its keys, its name for
    the logs, and the two calls through which it learns what became of its stream."""

    id: str
    initiator: bool
    peer_label: str
    peer_address: str
    route: Route
    last_seen: float
    express: ExpressLink | None
    express_seal: Seal | None

    @property
    def closed(self) -> bool: ...

    def take_ordered_mode(self, link: ExpressLink) -> bool:
        """``link`` bound: whether the session now sends its ordered messages on it."""

    def express_lost(self, link: ExpressLink, why: str) -> None:
        """``link`` broke or closed."""


SessionT = TypeVar("SessionT", bound=StreamSession)


class StreamOwner(Protocol[SessionT]):
    """What the port needs of its endpoint: the control channel whose poll watches the streams
    (and whose timers time them), the limits, the sessions by id, and where messages go."""

    channel: ControlChannel
    limits: Limits
    timeouts: Timeouts
    max_message_bytes: int

    @property
    def sessions(self) -> Mapping[str, SessionT]: ...

    def on_message(self, route: Route, session: SessionT, msg: Message) -> None:
        """A message read from ``session``'s stream, handled as if it came on the control channel."""


class ExpressPort(Generic[SessionT]):
    """An endpoint's express streams: the listener peers dial, the streams being dialled or
    bound, and the bound ones (I/O thread, except :meth:`close` once the loop has stopped)."""

    def __init__(self, endpoint: StreamOwner[SessionT], host: str) -> None:
        self._ep = endpoint
        bind_host = None if host in WILDCARDS else host
        # IPv4 unless the address is IPv6, as zmq resolves a name ("localhost" is often ::1 first).
        family = socket.AF_INET6 if bind_host and ":" in bind_host else socket.AF_INET
        family, kind, proto, _, addr = socket.getaddrinfo(
            bind_host, 0, family=family, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.bind(addr)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._unbound: collections.OrderedDict[int, _Unbound] = collections.OrderedDict()
        self._dialing: dict[int, tuple[socket.socket, SessionT, Any]] = {}
        self._links: dict[int, tuple[ExpressLink, SessionT]] = {}
        self._log = RateLimitedLog(log)

    def start(self) -> None:
        """I/O thread: start accepting."""
        self._ep.channel.watch_fd(self._listener.fileno(), self._accept)

    @property
    def links(self) -> int:
        return len(self._links)

    @property
    def unbound(self) -> int:
        """Streams accepted and not bound yet, and streams being dialled."""
        return len(self._unbound) + len(self._dialing)

    # -- acceptor ----------------------------------------------------------------------------

    def _accept(self, fd: int) -> None:
        channel, limits = self._ep.channel, self._ep.limits
        for _ in range(ACCEPTS_PER_PASS):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors, say: the listener stays readable, so rest instead of spinning.
                log.warning("express listener: accept failed (%s); pausing it for %g s", exc, ACCEPT_BACKOFF_S)
                channel.unwatch_fd(fd)
                channel.timers.call_later(ACCEPT_BACKOFF_S, self.start)
                return
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:  # reset already, say
                sock.close()
                self._log.warning("express listener: dropped a stream that failed at once (%s)", exc)
                continue
            while len(self._unbound) >= limits.max_pending_handshakes:
                old_fd = next(iter(self._unbound))
                self._drop_unbound(old_fd, "too many unbound express streams; the oldest goes")
            entry = _Unbound(sock)
            sfd = sock.fileno()
            entry.timer = channel.timers.call_later(
                self._ep.timeouts.connect, functools.partial(self._expire_unbound, sfd, entry)
            )
            self._unbound[sfd] = entry
            channel.watch_fd(sfd, self._on_unbound)

    def _expire_unbound(self, fd: int, entry: _Unbound) -> None:
        if self._unbound.get(fd) is entry:
            self._drop_unbound(fd, "an express stream did not bind within the connect timeout")

    def _drop_unbound(self, fd: int, why: str) -> None:
        entry = self._unbound.pop(fd, None)
        if entry is None:
            return
        self._ep.channel.unwatch_fd(fd)
        self._ep.channel.timers.cancel(entry.timer)
        with contextlib.suppress(OSError):
            entry.sock.close()
        self._log.warning("%s", why)

    def _on_unbound(self, fd: int) -> None:
        entry = self._unbound.get(fd)
        if entry is None:
            return
        try:
            data = entry.sock.recv(MAX_FRAME_BYTES + LENGTH.size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_unbound(fd, "an express stream closed before it bound")
            return
        try:
            # The binding frame alone: what follows it is cut under a bound stream's limit.
            frames = entry.reader.feed(data, most=1)
            if not frames:
                return
            session = self._bind(frames[0])
        except ProtocolError as exc:
            self._drop_unbound(fd, f"dropped an express stream that did not bind: {exc}")
            return
        del self._unbound[fd]
        self._ep.channel.timers.cancel(entry.timer)
        link = ExpressLink(entry.sock, self._seal_of(session), entry.reader)
        self._attach(session, link)
        try:
            rest = entry.reader.feed(b"")
        except ProtocolError as exc:
            self._close_bad(session, exc)
            return
        self._deliver(session, link, rest)

    def _bind(self, first: bytes) -> SessionT:
        """The session the binding frame ``first`` proves it belongs to."""
        raw_conn, sep, sealed = first.partition(b"\n")
        if not sep or not 0 < len(raw_conn) <= _MAX_CONN_ID:
            raise ProtocolError("no connection id")
        try:
            conn = raw_conn.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("a connection id that is not ASCII") from None
        session = self._ep.sessions.get(conn)
        if session is None or session.initiator or session.closed or session.express is not None:
            raise ProtocolError("no connection of that id is waiting for its express stream")
        body = self._seal_of(session).open(sealed)
        if body is None:
            raise ProtocolError("its binding frame failed authentication (forged, replayed or corrupted)")
        msg = decode(body, limit=MAX_FRAME_BYTES)
        if msg.type != "express" or msg["conn"] != conn:
            raise ProtocolError(f"its first message is {msg.type}, not its binding")
        return session

    # -- initiator ---------------------------------------------------------------------------

    def dial(self, session: SessionT, port: int) -> None:
        """Initiator, I/O thread: open the stream to the acceptor's express ``port`` (without
        blocking: the connect completes in a later loop pass)."""
        host = address_host(session.peer_address)
        host = "127.0.0.1" if host == "localhost" else host
        try:
            # A numeric address only: a name lookup could block the loop.
            family, kind, proto, _, addr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST
            )[0]
        except (socket.gaierror, UnicodeError) as exc:
            log.debug("%s: no express stream (%s is not a numeric address: %s)", session.peer_label, host, exc)
            return
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:  # out of descriptors, say: the session goes on without
            log.warning("%s: no express stream (%s)", session.peer_label, exc)
            return
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = sock.connect_ex(addr)
        except OSError as exc:
            err = exc.errno or -1
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            log.debug("%s: no express stream (connect: %s)", session.peer_label, errno.errorcode.get(err, err))
            return
        fd = sock.fileno()
        channel = self._ep.channel
        timer = channel.timers.call_later(self._ep.timeouts.connect, functools.partial(self._give_up, fd, sock))
        self._dialing[fd] = (sock, session, timer)
        channel.watch_fd(fd, self._on_dialed, writable=True)

    def _give_up(self, fd: int, sock: socket.socket) -> None:
        entry = self._dialing.get(fd)
        if entry is not None and entry[0] is sock:
            del self._dialing[fd]
            self._ep.channel.unwatch_fd(fd)
            sock.close()
            log.debug("%s: no express stream (its connect timed out)", entry[1].peer_label)

    def _on_dialed(self, fd: int) -> None:
        entry = self._dialing.pop(fd, None)
        channel = self._ep.channel
        channel.unwatch_fd(fd)
        if entry is None:
            return
        sock, session, timer = entry
        channel.timers.cancel(timer)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err or session.closed or session.express is not None or session.express_seal is None:
            sock.close()
            if err:
                log.debug("%s: no express stream (connect: %s)", session.peer_label, errno.errorcode.get(err, err))
            return
        link = ExpressLink(sock, session.express_seal)
        if not link.send_bind(session.id):
            link.close()
            return
        self._attach(session, link)

    # -- both --------------------------------------------------------------------------------

    @staticmethod
    def _seal_of(session: SessionT) -> Seal:
        assert session.express_seal is not None
        return session.express_seal

    def _attach(self, session: SessionT, link: ExpressLink) -> None:
        # Bound, so authenticated: it may carry any session message (ordered mode), up to the
        # control channel's size limit.
        link.reader.limit = bound_frame_bytes(self._ep.max_message_bytes)
        link.backlog_limit = BACKLOG_FRAMES * link.reader.limit
        link.on_backlog = self._backlog_started
        session.express = link
        self._links[link.fd] = (link, session)
        self._ep.channel.watch_fd(link.fd, self._on_link)
        ordered = session.take_ordered_mode(link)
        log.debug("%s: express stream open%s", session.peer_label, " (ordered mode)" if ordered else "")

    def _on_link(self, fd: int) -> None:
        entry = self._links.get(fd)
        if entry is None:
            return
        link, session = entry
        for _ in range(READS_PER_PASS):
            try:
                frames = link.read()
            except ProtocolError as exc:  # a frame of a forbidden length
                self._close_bad(session, exc)
                return
            if frames is None:
                self.detach(session, "the stream closed")
                return
            self._deliver(session, link, frames)
            if not frames or link.last_read >= READ_BYTES or self._links.get(fd) is not entry:
                return

    # -- backlogs (ordered mode: what the socket had no room for) ------------------------------

    def _backlog_started(self, link: ExpressLink) -> None:
        """Any thread: ``link`` holds bytes its socket had no room for; the I/O thread writes
        them out as the peer reads."""
        channel = self._ep.channel
        if channel.in_io_thread():
            self._watch_room(link)
            return
        try:
            # Never waits for room in the call queue: the writer may hold a transfer's lock
            # that the I/O thread needs. One call per backlog that starts, so few.
            channel.call_soon(functools.partial(self._watch_room, link), wait=False)
        except ChannelDown:
            link.abort()  # no thread left to write it out: the stream fails, not stalls

    def _watch_room(self, link: ExpressLink) -> None:
        """I/O thread: write ``link``'s backlog out each time its socket has room, and fail the
        stream if the peer takes none of it for the heartbeat timeout."""
        entry = self._links.get(link.fd)
        if entry is None or entry[0] is not link or not link.backlog:
            return
        channel = self._ep.channel
        channel.watch_writable(link.fd, self._on_room)
        if link.stall_timer is None:
            link.stall_timer = channel.timers.call_later(
                self._ep.timeouts.heartbeat_timeout, functools.partial(self._check_stall, link)
            )

    def _on_room(self, fd: int) -> None:
        entry = self._links.get(fd)
        if entry is None:
            self._ep.channel.unwatch_writable(fd)
            return
        link, session = entry
        written = link.flush()
        if written is None:
            self.detach(session, "a write to it failed")
        elif written:
            self._ep.channel.unwatch_writable(fd)

    def _check_stall(self, link: ExpressLink) -> None:
        link.stall_timer = None
        entry = self._links.get(link.fd)
        if entry is None or entry[0] is not link:
            return
        limit = self._ep.timeouts.heartbeat_timeout
        stalled = link.stalled_for(time.monotonic())
        if stalled >= limit:
            self.detach(entry[1], f"its peer read none of the {link.backlog} bytes waiting for it for {stalled:.1f} s")
        elif link.backlog:
            link.stall_timer = self._ep.channel.timers.call_later(
                limit - stalled, functools.partial(self._check_stall, link)
            )

    def _close_bad(self, session: SessionT, exc: ProtocolError) -> None:
        self._log.warning("%s: closing its express stream: %s", session.peer_label, exc)
        self.detach(session, str(exc))

    def _deliver(self, session: SessionT, link: ExpressLink, frames: list[bytes]) -> None:
        """Each authentic frame's message, handled as if it came on the control channel; the
        first that is not closes the stream."""
        try:
            self._handle(session, link, frames)
        except ProtocolError as exc:
            self._close_bad(session, exc)

    def _handle(self, session: SessionT, link: ExpressLink, frames: list[bytes]) -> None:
        for data in frames:
            if session.express is not link:
                return  # the session ended (or the stream was closed) while handling the last one
            body = link.seal.open(data)
            if body is None:
                raise ProtocolError("a frame failed authentication (forged, replayed or corrupted)")
            msg = decode(body, limit=self._ep.max_message_bytes)
            if msg.type not in ORDERED_KINDS:
                raise ProtocolError(f"a {msg.type} message (the stream carries {', '.join(sorted(ORDERED_KINDS))})")
            session.last_seen = time.monotonic()
            self._ep.on_message(session.route, session, msg)

    def detach(self, session: SessionT, why: str = "") -> None:
        """I/O thread: close ``session``'s stream, if it has one (the session goes on)."""
        link = session.express
        if link is None:
            return
        session.express = None
        self._links.pop(link.fd, None)
        self._ep.channel.unwatch_fd(link.fd)
        link.close()
        log.debug("%s: express stream closed%s", session.peer_label, f" ({why})" if why else "")
        session.express_lost(link, f"closed ({why or 'by this side'})")

    def close(self) -> None:
        """Close every stream and the listener: on the I/O thread, or once it has stopped.
        Idempotent; never raises."""
        channel = self._ep.channel
        for link, session in list(self._links.values()):
            session.express = None
            channel.unwatch_fd(link.fd)
            link.close()
        self._links.clear()
        for fd, entry in list(self._unbound.items()):
            channel.unwatch_fd(fd)
            with contextlib.suppress(OSError):
                entry.sock.close()
        self._unbound.clear()
        for fd, (sock, _, _) in list(self._dialing.items()):
            channel.unwatch_fd(fd)
            with contextlib.suppress(OSError):
                sock.close()
        self._dialing.clear()
        if self._listener.fileno() >= 0:
            channel.unwatch_fd(self._listener.fileno())
        with contextlib.suppress(OSError):
            self._listener.close()
