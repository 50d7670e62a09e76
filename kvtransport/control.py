"""The control channel's sockets: one ROUTER bound per endpoint, one DEALER per outgoing
connection, all owned by a single I/O thread.

zmq sockets are not thread-safe, so other threads never touch them: they queue calls with
:meth:`ControlChannel.call_soon`, and a socket pair wakes the loop. The loop hands every
received frame to the endpoint's handler with the route it came from; routes are opaque keys
(``("in", identity)`` for peers that connected to us, ``("out", address)`` for peers we
connected to).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger(__name__)

Route = tuple[str, Any]

_WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}


def advertised_host(listen: str) -> str:
    """The host part of a ``tcp://host:port`` listen address, as peers should dial it.

    A wildcard bind (``tcp://*:5555``) advertises this machine's primary address, falling back
    to loopback when the host name does not resolve.
    """
    host = listen.split("://", 1)[-1].rsplit(":", 1)[0]
    if host not in _WILDCARDS:
        return host.strip("[]")
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ControlChannel:
    def __init__(
        self,
        listen: str,
        on_frame: Callable[[Route, bytes], None],
        on_tick: Callable[[], None],
        tick_s: float = 0.005,
    ) -> None:
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        host_port = listen.rsplit(":", 1)
        if host_port[-1] == "0":
            port = self._router.bind_to_random_port(host_port[0])
        else:
            self._router.bind(listen)
            port = int(host_port[-1])
        # What peers dial: a wildcard bind advertises this machine's address instead.
        self.address = f"tcp://{advertised_host(listen)}:{port}"
        wake_addr = f"inproc://kvtransport-wake-{uuid.uuid4().hex}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._on_frame = on_frame
        self._on_tick = on_tick
        self._tick_ms = max(1, int(tick_s * 1000))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvtransport-io {self.address}", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._calls.put(fn)
        with self._wake_lock:
            if not self._stop.is_set():
                self._wake_tx.send(b"", zmq.NOBLOCK)

    def in_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, final: Callable[[], None] | None = None, timeout: float = 2.0) -> None:
        if final is not None and self._thread.is_alive():
            done = threading.Event()

            def run_final() -> None:
                try:
                    final()
                finally:
                    done.set()

            self.call_soon(run_final)
            done.wait(timeout)
        with self._wake_lock:
            self._stop.set()
            self._wake_tx.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout)

    # -- I/O thread only ---------------------------------------------------------------------

    def connect(self, address: str) -> Route:
        if address not in self._dealers:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._dealers[address] = sock
            self._poller.register(sock, zmq.POLLIN)
        return ("out", address)

    def disconnect(self, route: Route) -> None:
        if route[0] == "out":
            sock = self._dealers.pop(route[1], None)
            if sock is not None:
                self._poller.unregister(sock)
                sock.close(0)

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
        try:
            while not self._stop.is_set():
                events = dict(self._poller.poll(self._tick_ms))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                self._drain_calls()
                if self._router in events:
                    self._receive_router()
                for address, sock in list(self._dealers.items()):
                    if sock in events:
                        self._receive_dealer(address, sock)
                self._on_tick()
            self._drain_calls()
        except Exception:
            log.exception("kvtransport I/O loop crashed")
        finally:
            for sock in self._dealers.values():
                sock.close(0)
            self._router.close(0)
            self._wake_rx.close(0)
            with self._wake_lock:
                self._wake_tx.close(0)
            self._ctx.term()

    def _drain_calls(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("kvtransport I/O call failed")

    def _receive_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropping a control message with %d frames (expected 2)", len(frames))
                continue
            self._on_frame(("in", frames[0]), frames[1])

    def _receive_dealer(self, address: str, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                log.warning("dropping a control message from %s with %d frames", address, len(frames))
                continue
            self._on_frame(("out", address), frames[0])
