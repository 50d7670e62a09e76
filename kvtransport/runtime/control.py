"""The control channel's sockets: one ROUTER bound per endpoint, one DEALER per outgoing
connection, all owned by a single I/O thread.

zmq sockets are not thread-safe, so other threads never touch them: they queue calls with
:meth:`ControlChannel.call_soon`, and a socket pair wakes the loop. The loop hands every
received frame to the endpoint's handler with the route it came from; routes are opaque keys
(``("in", identity)`` for peers that connected to us, ``("out", address)`` for peers we
connected to, one DEALER and route per connection).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from kvtransport.runtime.timers import TimerHeap
from kvtransport.runtime.unclaimed import UnclaimedConnections
from kvtransport.spi.errors import ChannelDown, ConfigError

log = logging.getLogger(__name__)

Route = tuple[str, Any]

#: Hosts of a listen address that bind every interface.
WILDCARDS = frozenset({"*", "0.0.0.0", "::", ""})


def address_host(address: str) -> str:
    """The host part of a ``tcp://host:port`` address, without an IPv6 address's brackets."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def advertised_host(listen: str) -> str:
    """The host part of a ``tcp://host:port`` listen address, as peers should dial it.

    A wildcard bind (``tcp://*:5555``) advertises this machine's primary address, falling back
    to loopback when the host name does not resolve.
    """
    host = address_host(listen)
    if host not in WILDCARDS:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ControlChannel:
    """Sockets, queued calls and timers, all run by one I/O thread.

    Each loop pass: run queued calls, receive at most ``frames_per_pass`` frames per socket,
    run due timers, then block in ``poll`` until a frame, a call or the next timer. No pass can
    starve the timers (heartbeats go out under a flood), and an idle channel wakes for nothing.
    """

    def __init__(
        self,
        listen: str,
        on_frame: Callable[[Route, bytes], None],
        *,
        max_message_bytes: int,
        frames_per_pass: int = 256,
        max_queued_calls: int = 65536,
        on_crash: Callable[[BaseException], None] | None = None,
        unclaimed_timeout: float = 10.0,
        max_unclaimed: int = 256,
    ) -> None:
        self._ctx = zmq.Context()
        self._max_message_bytes = max_message_bytes
        self._router = self._socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            host_port = listen.rsplit(":", 1)
            if host_port[-1] == "0":
                port = self._router.bind_to_random_port(host_port[0])
            else:
                self._router.bind(listen)
                port = int(host_port[-1])
        except (zmq.ZMQError, ValueError) as exc:
            self._router.close(0)
            self._ctx.term()
            raise ConfigError(f"cannot listen on {listen!r}: {exc}") from exc
        # What peers dial: a wildcard bind advertises this machine's address instead.
        self.address = f"tcp://{advertised_host(listen)}:{port}"
        wake_addr = f"inproc://kvtransport-wake-{uuid.uuid4().hex}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        # One wake-up byte in flight at most: callers set the flag, the loop clears it before
        # draining, so the pair socket can never fill up (and never raise zmq.Again).
        self._wake_lock = threading.Lock()
        self._wake_pending = False
        self._send_lock = threading.Lock()  # the only lock around _wake_tx
        self._tx_closed = False
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._calls_space = threading.Condition(self._wake_lock)
        self._max_queued_calls = max_queued_calls
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        #: Plain file descriptors the loop waits on beside its sockets (the express streams),
        #: with the events each waits for; and those also watched for room to write.
        self._fds: dict[int, Callable[[int], None]] = {}
        self._masks: dict[int, int] = {}
        self._writers: dict[int, Callable[[int], None]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self.timers = TimerHeap()
        #: Accepted connections that carry no session yet: bounded in number and time.
        self.unclaimed = UnclaimedConnections(
            self._router, port, self.timers, timeout=unclaimed_timeout, most=max_unclaimed
        )
        #: The descriptor of the ROUTER message being handled (``claim`` reads it), and the
        #: descriptor of each claimed route's connection.
        self._current_fd = -1
        #: The ROUTER message being handled (``peer_address`` reads it), else None.
        self._current_frame: Any = None
        self._route_fd: dict[bytes, tuple[int, Any]] = {}
        self._poller.register(self.unclaimed.monitor, zmq.POLLIN)
        self._on_frame = on_frame
        self._on_crash = on_crash
        self._frames_per_pass = frames_per_pass
        self._stop = threading.Event()
        self._running = True
        #: Loop passes so far (each is one wake-up): an idle channel does not add any.
        self.passes = 0
        self._thread = threading.Thread(target=self._run, name=f"kvtransport-io {self.address}", daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # zmq drops (and disconnects) a peer whose message is larger: nothing oversized is ever
        # buffered, let alone decoded. A little room for framing.
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes + 1024)
        return sock

    # -- any thread ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._running

    def call_soon(self, fn: Callable[[], None], timeout: float = 10.0, *, wait: bool = True) -> None:
        """Queue ``fn`` for the I/O thread. When ``max_queued_calls`` are waiting, the caller
        blocks until there is room (backpressure) and gets :class:`ChannelDown` after
        ``timeout`` or once the loop has stopped. The I/O thread itself never blocks here, nor
        does a caller with ``wait=False`` (for calls bounded in number by other means, made
        where blocking could deadlock with the I/O thread)."""
        in_loop = self.in_io_thread()
        with self._wake_lock:
            if not self._running:
                raise ChannelDown("the endpoint's I/O thread is not running")
            if wait and not in_loop and len(self._calls) >= self._max_queued_calls:
                if not self._calls_space.wait_for(
                    lambda: len(self._calls) < self._max_queued_calls or not self._running, timeout
                ):
                    raise ChannelDown(f"the endpoint's I/O thread has {len(self._calls)} calls queued for {timeout} s")
                if not self._running:
                    raise ChannelDown("the endpoint's I/O thread is not running")
            self._calls.append(fn)
            wake = not self._wake_pending and not in_loop
            if wake:
                self._wake_pending = True
        if wake:
            # Outside the queue's lock, so the I/O thread never waits for a caller's send.
            self._send_wake()

    def _send_wake(self) -> None:
        with self._send_lock:
            if not self._tx_closed:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # already woken: a byte is waiting

    def in_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, final: Callable[[], None] | None = None, timeout: float = 2.0) -> None:
        """Run ``final`` on the I/O thread (if it still runs), then stop it. Never raises."""
        if final is not None and self._running and not self.in_io_thread():
            done = threading.Event()

            def run_final() -> None:
                try:
                    final()
                finally:
                    done.set()

            try:
                self.call_soon(run_final, timeout=timeout)
                done.wait(timeout)
            except ChannelDown:
                pass
        self._stop.set()
        self._send_wake()
        if not self.in_io_thread():
            self._thread.join(timeout)

    # -- I/O thread only ---------------------------------------------------------------------

    def connect(self, address: str, key: str) -> Route:
        """A DEALER of its own for one outgoing connection (``key``: the connection id), so
        two connections to one address never share a route."""
        if key not in self._dealers:
            sock = self._socket(zmq.DEALER)
            sock.connect(address)
            self._dealers[key] = sock
            self._poller.register(sock, zmq.POLLIN)
        return ("out", key)

    def claim(self, route: Route) -> None:
        """While its message is handled: the connection that message of ``route`` (one a peer
        opened) came in on carries a session now."""
        if route[0] == "in" and self._current_fd >= 0:
            key = self.unclaimed.claim(self._current_fd)
            if key is not None:
                self._route_fd[route[1]] = (self._current_fd, key)

    def peer_address(self) -> str:
        """While its message is handled: the source address of the connection a peer opened to
        this endpoint (zmq's ``Peer-Address``: the TCP peer's IP), or "" where zmq knows none.
        Only the transport says it, never the peer: it is what a stranger's attempts may be
        known by."""
        frame = self._current_frame
        if frame is None:
            return ""
        try:
            return str(frame.get("Peer-Address"))
        except (zmq.ZMQError, TypeError, ValueError):
            return ""

    def disconnect(self, route: Route) -> None:
        if route[0] == "in":
            claimed = self._route_fd.pop(route[1], None)
            if claimed is not None:
                self.unclaimed.release(*claimed)  # carries no session any more
        if route[0] == "out":
            sock = self._dealers.pop(route[1], None)
            if sock is not None:
                self._poller.unregister(sock)
                sock.close(0)

    def watch_fd(self, fd: int, on_ready: Callable[[int], None], *, writable: bool = False) -> None:
        """Call ``on_ready(fd)`` on this thread each time ``fd`` is readable (or ``writable``);
        a raising handler is logged, never stops the loop. Watching again replaces the events."""
        self._fds[fd] = on_ready
        self._masks[fd] = zmq.POLLOUT if writable else zmq.POLLIN
        self._register(fd)

    def unwatch_fd(self, fd: int) -> None:
        """Stop watching ``fd`` (for reading, and for room to write)."""
        watched = fd in self._fds or fd in self._writers
        self._fds.pop(fd, None)
        self._masks.pop(fd, None)
        self._writers.pop(fd, None)
        if watched:
            self._poller.unregister(fd)

    def watch_writable(self, fd: int, on_room: Callable[[int], None]) -> None:
        """Also call ``on_room(fd)`` on this thread each time ``fd`` has room to write, until
        :meth:`unwatch_writable`; a raising handler is logged, never stops the loop."""
        self._writers[fd] = on_room
        self._register(fd)

    def unwatch_writable(self, fd: int) -> None:
        if self._writers.pop(fd, None) is not None:
            self._register(fd)

    def _register(self, fd: int) -> None:
        # Registering again replaces the events; no events at all unregisters.
        self._poller.register(fd, self._masks.get(fd, 0) | (zmq.POLLOUT if fd in self._writers else 0))

    @property
    def dealer_count(self) -> int:
        return len(self._dealers)

    def send(self, route: Route, data: bytes) -> bool:
        """Send one frame; ``False`` when the peer is gone or its queue is full."""
        try:
            if route[0] == "in":
                self._router.send_multipart([route[1], data], zmq.NOBLOCK)
            else:
                sock = self._dealers.get(route[1])
                if sock is None:
                    return False
                sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.debug("send to %s failed: %s", route, exc)
            return False

    def _run(self) -> None:
        crash: BaseException | None = None
        try:
            while not self._stop.is_set():
                delay = self.timers.next_delay(time.monotonic())
                with self._wake_lock:
                    if self._calls:
                        delay = 0.0
                timeout_ms = -1 if delay is None else int(delay * 1000) + (1 if delay > 0 else 0)
                # Handlers as they were when the poll began: a descriptor closed during this pass
                # and reused by a stream registered meanwhile must not get the old one's event.
                fds = dict(self._fds)
                writers = dict(self._writers)
                events = dict(self._poller.poll(timeout_ms))
                self.passes += 1
                if self._wake_rx in events:
                    self._clear_wake()
                self._drain_calls()
                if self.unclaimed.monitor in events:
                    self.unclaimed.on_events()
                if self._router in events:
                    self._receive(self._router, "in")
                for key, sock in list(self._dealers.items()):
                    # A handler may have closed a later dealer during this pass.
                    if sock in events and self._dealers.get(key) is sock:
                        self._receive(sock, key)
                for fd, handler in writers.items():
                    if events.get(fd, 0) & (zmq.POLLOUT | zmq.POLLERR) and self._writers.get(fd) is handler:
                        try:
                            handler(fd)
                        except Exception:
                            log.exception("kvtransport: writing to a stream failed")
                for fd, handler in fds.items():
                    # Its own events (room alone is for the writer above), or an error.
                    wanted = self._masks.get(fd, 0) | zmq.POLLERR
                    if events.get(fd, 0) & wanted and self._fds.get(fd) is handler:
                        try:
                            handler(fd)
                        except Exception:
                            log.exception("kvtransport: handling a ready stream failed")
                self.timers.run_due(time.monotonic())
            self._drain_calls()
        except BaseException as exc:
            crash = exc
            log.exception("kvtransport I/O loop stopped by a fault")
        finally:
            with self._wake_lock:
                self._running = False
                self._calls_space.notify_all()
                leftover = len(self._calls)
                self._calls.clear()
            if leftover:
                log.debug("%d queued I/O calls dropped at shutdown", leftover)
            if crash is not None and self._on_crash is not None:
                try:
                    self._on_crash(crash)
                except Exception:
                    log.exception("kvtransport crash handler failed")
            for sock in self._dealers.values():
                sock.close(0)
            self._dealers.clear()
            self.unclaimed.close()
            self._router.close(0)
            self._wake_rx.close(0)
            with self._send_lock:
                self._wake_tx.close(0)
                self._tx_closed = True
            self._ctx.term()

    def _clear_wake(self) -> None:
        # Drain first, then clear the flag: while it is set no caller sends another byte, so a
        # call queued meanwhile is either drained in this pass or announced by a fresh byte.
        while int(self._wake_rx.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._wake_rx.recv(zmq.NOBLOCK)
        with self._wake_lock:
            self._wake_pending = False

    def _drain_calls(self) -> None:
        # Only the calls queued when the pass began: a call that queues another (or a flood of
        # callers) cannot keep the loop from its sockets and timers.
        with self._wake_lock:
            calls, self._calls = self._calls, collections.deque()
            if calls:
                self._calls_space.notify_all()
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("kvtransport I/O call failed")

    def _receive(self, sock: zmq.Socket[bytes], source: str) -> None:
        for _ in range(self._frames_per_pass):
            if sock.closed:
                return
            try:
                # The ROUTER's frames as zmq's own (no copy yet): each one says which connection
                # it came from, which ``unclaimed`` needs.
                frames: list[Any] = sock.recv_multipart(zmq.NOBLOCK, copy=source != "in")
            except zmq.Again:
                return
            if source == "in":
                if len(frames) != 2:
                    log.debug("dropping a control message with %d frames (expected 2)", len(frames))
                    continue
                route: Route = ("in", frames[0].bytes)
                self._current_frame = frames[1]
                try:
                    self._current_fd = frames[1].get(zmq.SRCFD)
                except zmq.ZMQError:  # zmq knows no descriptor for it: it cannot be claimed
                    self._current_fd = -1
                frame = frames[1].bytes
            else:
                if len(frames) != 1:
                    log.debug("dropping a control message from %s with %d frames", source, len(frames))
                    continue
                route, frame = ("out", source), frames[0]
            try:
                self._on_frame(route, frame)
            except Exception:
                log.exception("kvtransport: handling a control message failed")
            finally:
                self._current_fd = -1
                self._current_frame = None
