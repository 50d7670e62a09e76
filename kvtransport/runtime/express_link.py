"""The express stream itself: its framing and one bound stream.

Framing: a frame is its length (4 bytes, big-endian), then a sealed message; ``FrameReader``
cuts a byte stream into frames, refusing an empty one or one over its limit (``MAX_FRAME_BYTES``
before the stream binds, ``bound_frame_bytes`` of the control channel's limit after).
``ORDERED_KINDS`` are the messages a bound stream carries.

One bound stream, ``ExpressLink``: sealed frames written from any thread, one write at a time
under its lock; in ordered mode what the socket has no room for waits in its backlog (at most
``BACKLOG_FRAMES`` of its largest frames), which the I/O thread writes out as the peer reads;
frames read on the I/O thread. The port that accepts, dials and binds streams, and hands their
messages to the endpoint, is :mod:`kvtransport.runtime.express`, which also tells why the stream
exists and what it carries.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtransport.runtime.auth import Seal
from kvtransport.runtime.wire import encode
from kvtransport.spi.errors import ProtocolError

log = logging.getLogger(__name__)

#: A frame's length, ahead of it: 4 bytes, big-endian.
LENGTH = struct.Struct(">I")
#: Largest frame either side takes: "done" with a 256-character tag is under 1.2 KiB sealed.
MAX_FRAME_BYTES = 4096
#: What a session in ordered mode sends on its stream: every message whose order counts against
#: a two-sided driver's notices (a chunk's notice must reach the peer before the "done" or
#: "drained" that follows it, a "lane_down" before the "done" of a transfer it moved). "bye"
#: goes on the control channel as well (its order does not matter, and it should arrive even if
#: the stream is gone). What a bound stream takes: these
#: (a one-sided session sends "done" only); pings and the handshake never.
ORDERED_KINDS = frozenset({"expect", "done", "abort", "drained", "notice", "lane_down", "bye"})
#: Seal header and MAC on top of a message (auth.Seal).
_SEAL_BYTES = 64
#: Bytes one read of a stream takes; at most ``express.READS_PER_PASS`` reads a loop pass (a
#: flood cannot hold the loop).
READ_BYTES = 64 << 10
#: A bound stream's backlog (bytes its peer has not read yet, see ``ExpressLink.send_many``) may
#: hold this many of its largest frames; more, and the peer is not reading: the stream fails.
BACKLOG_FRAMES = 8
#: A write to a stream the peer reset must raise, never deliver SIGPIPE (an embedding
#: application may not ignore it, as CPython does).
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def bound_frame_bytes(limit: int) -> int:
    """Largest frame a bound stream takes: a sealed message of the control channel's limit."""
    return limit + _SEAL_BYTES


def frame(data: bytes) -> bytes:
    """``data`` as one frame of the stream: its length (4 bytes, big-endian), then itself."""
    return LENGTH.pack(len(data)) + data


class FrameReader:
    """Cuts a byte stream into frames; one longer than ``limit`` (or empty) is a protocol error."""

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._limit = limit

    @property
    def pending(self) -> int:
        return len(self._buf)

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = value

    def feed(self, data: bytes, most: int | None = None) -> list[bytes]:
        """The whole frames ``data`` completes (at most ``most``; the rest stays buffered)."""
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= LENGTH.size and (most is None or len(out) < most):
            (n,) = LENGTH.unpack_from(self._buf)
            if not 0 < n <= self._limit:
                raise ProtocolError(f"express frame of {n} bytes (1 to {self._limit})")
            end = LENGTH.size + n
            if len(self._buf) < end:
                break
            out.append(bytes(self._buf[LENGTH.size : end]))
            del self._buf[:end]
        return out


class ExpressLink:
    """One session's bound stream: sealed frames out from any thread, in on the I/O thread."""

    def __init__(self, sock: socket.socket, seal: Seal, reader: FrameReader | None = None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.seal = seal
        self.reader = reader or FrameReader()
        self._lock = threading.Lock()
        self._closed = False
        #: Frames written and read (``Endpoint.stats`` and the tests read them).
        self.sent = 0
        self.received = 0
        #: Bytes the last :meth:`read` took from the socket.
        self.last_read = 0
        #: Queued writes (``send_many(queue=True)``) the socket had no room for, oldest first:
        #: the I/O thread writes them out (:meth:`flush`) as the peer reads.
        self._backlog = bytearray()
        self._backlog_frames = 0
        #: Most bytes the backlog may hold (set when the stream binds); more fails the stream.
        self.backlog_limit = 1 << 62
        #: When the peer last took some of the backlog (or it began): ``stalled_for`` reads it.
        self._backlog_moved = 0.0
        #: Called, on the writing thread and outside the stream's lock, when the backlog stops
        #: being empty: the I/O thread must watch the socket for room (``ExpressPort`` sets it).
        self.on_backlog: Callable[[ExpressLink], None] | None = None
        #: I/O thread: the timer that fails the stream if its backlog stalls (``ExpressPort``).
        self.stall_timer: Any = None

    def send(self, body: bytes) -> bool:
        """Any thread: ``body`` sealed, as one frame, if it can go out whole now. ``False`` when
        it could not: nothing of it left (the kernel's buffer is full, or a backlog waits; the
        stream stays usable), or part of it did or the stream failed (it is then shut down, and
        the I/O thread closes it)."""
        return self.send_many((body,))

    def send_many(self, bodies: Sequence[bytes], *, queue: bool = False) -> bool:
        """Any thread: each of ``bodies`` sealed as a frame of its own, in order, all in one
        write, so the peer reads them in one wake-up (a chunk's notice and the "done" behind
        it). All or nothing, as :meth:`send` for one. ``queue`` (ordered mode, where a frame
        has no other way to go): what the socket has no room for waits in the stream's backlog,
        after what waits there already, and nobody waits for it; ``False`` only when the stream
        failed (or the backlog grew past its limit, which fails it)."""
        with self._lock:
            if self._closed:
                return False
            seal = self.seal.seal
            data = frame(seal(bodies[0])) if len(bodies) == 1 else b"".join([frame(seal(body)) for body in bodies])
            if not queue:
                return not self._backlog and self._write(data, len(bodies))
            if self._backlog:
                return self._queue(data, len(bodies), started=False)
            try:
                n = self.sock.send(data, _NOSIGNAL)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                log.debug("express stream write failed: %s", exc)
                self._fail()
                return False
            if n == len(data):
                self.sent += len(bodies)
                return True
            if not self._queue(data[n:], len(bodies), started=True):
                return False
        # Outside the lock: the I/O thread's flush takes it.
        if self.on_backlog is not None:
            self.on_backlog(self)
        return True

    def _queue(self, data: bytes, frames: int, *, started: bool) -> bool:
        """Lock held: ``data`` behind the backlog (``started``: the backlog was empty)."""
        if len(self._backlog) + len(data) > self.backlog_limit:
            log.debug("express stream: its peer left more than %d bytes unread", self.backlog_limit)
            self._fail()
            return False
        if started:
            self._backlog_moved = time.monotonic()
        self._backlog += data
        self._backlog_frames += frames
        return True

    @property
    def backlog(self) -> int:
        """Bytes waiting for the peer to read (ordered mode)."""
        return len(self._backlog)

    def stalled_for(self, now: float) -> float:
        """Seconds since the peer last took part of a backlog that is still there (0 without one)."""
        with self._lock:
            return now - self._backlog_moved if self._backlog else 0.0

    def flush(self) -> bool | None:
        """I/O thread, when the socket has room: write out what the backlog holds, without
        waiting. ``True`` once it is empty, ``False`` while some is left, ``None`` when the
        stream failed."""
        with self._lock:
            if self._closed:
                return None
            if not self._backlog:
                return True
            try:
                n = self.sock.send(self._backlog, _NOSIGNAL)
            except BlockingIOError:
                return False
            except OSError as exc:
                log.debug("express stream write failed: %s", exc)
                self._fail()
                return None
            if n > 0:
                del self._backlog[:n]
                self._backlog_moved = time.monotonic()
            if self._backlog:
                return False
            self.sent += self._backlog_frames
            self._backlog_frames = 0
            return True

    def _fail(self) -> None:
        """Lock held: part of a frame cannot be taken back, so the stream is unusable from
        here: shut down (the I/O thread sees it end and closes it)."""
        self._closed = True
        self._backlog.clear()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def abort(self) -> None:
        """Any thread: fail the stream (its backlog can no longer be written out)."""
        with self._lock:
            if not self._closed:
                self._fail()

    def send_bind(self, conn: str) -> bool:
        """Initiator, I/O thread: the binding frame (the connection id, then a sealed
        "express" message naming it)."""
        with self._lock:
            if self._closed:
                return False
            return self._write(frame(conn.encode() + b"\n" + self.seal.seal(encode("express", conn=conn))))

    def _write(self, data: bytes, frames: int = 1) -> bool:
        try:
            n = self.sock.send(data, _NOSIGNAL)
        except BlockingIOError:
            return False
        except OSError as exc:
            log.debug("express stream write failed: %s", exc)
            n = -1
        if n == len(data):
            self.sent += frames
            return True
        self._fail()
        return False

    def read(self) -> list[bytes] | None:
        """I/O thread: the whole frames that arrived (``None``: the stream ended or failed)."""
        self.last_read = 0
        try:
            data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.last_read = len(data)
        frames = self.reader.feed(data)
        self.received += len(frames)
        return frames

    def close(self) -> None:
        with self._lock:
            if not self._closed and self._backlog:
                # What the socket takes now of what waits (a "done" the sender counted as sent,
                # say) still reaches the peer: written before the close, as a wait once did.
                with contextlib.suppress(OSError):
                    self.sock.send(self._backlog, _NOSIGNAL)
                self._backlog.clear()
            self._closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
