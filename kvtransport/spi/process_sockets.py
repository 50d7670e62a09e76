"""This process's TCP sockets, and whether a peer process still runs: what drivers need to fence.

A one-sided engine (Mooncake over TCP, UCX over TCP) writes whatever arrives on its data
connections into registered memory; the engine itself offers no call that stops one peer's
bytes. What the operating system offers is the connection: ``shutdown(2)`` on our end of it
makes the kernel refuse any later segment of it (the peer gets a reset, and nothing more reaches
the engine), and the bytes already queued in the kernel are either read by the engine (they were
sent before the fence) or discarded with the socket. This module finds such sockets without
touching the engine's file descriptors in a way that could race with it:

- :func:`tcp_sockets` lists the process's TCP sockets (``/proc/self/fd`` joined with
  ``/proc/self/net/tcp{,6}`` by socket inode);
- :func:`new_listeners` names the listening sockets an engine opened while it started (taken
  under one process-wide lock, so two engines starting at once do not see each other's);
- :func:`sever` shuts down every established connection accepted on given listening ports,
  through a duplicate of the descriptor whose inode was checked first (a descriptor number the
  engine closed and reused meanwhile is left alone), and waits until the engine has read what
  the kernel had queued for it.

An engine that writes into a peer's memory without any connection of the receiver's (UCX's
cross-memory attach between processes of one host) cannot be fenced by the receiver at all:
only the writer's end stops it. :func:`process_start` and :func:`process_alive` tell a driver
whether that process (identified by pid and start time, so a reused pid is not mistaken for it)
still runs.

Linux only (``/proc``); elsewhere :func:`supported` is ``False`` and drivers say they cannot
fence. Nothing here imports an engine.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

#: ``/proc/net/tcp`` state codes.
ESTABLISHED = "01"
LISTEN = "0A"

_PROC_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
#: Held while an engine starts and its new listeners are read (:func:`new_listeners`).
_START_LOCK = threading.Lock()


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process: a descriptor that refers to it, and its addresses."""

    fd: int
    inode: int
    local_port: int
    remote_port: int
    state: str
    rx_queue: int


def supported() -> bool:
    """Whether this platform lets a driver list and sever its engine's connections."""
    return os.path.isdir("/proc/self/fd") and os.path.exists(_PROC_TABLES[0])


def _table() -> dict[int, tuple[int, int, str, int]]:
    """inode -> (local port, remote port, state, receive queue bytes) of the process's network
    namespace's TCP sockets."""
    rows: dict[int, tuple[int, int, str, int]] = {}
    for path in _PROC_TABLES:
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            p = line.split()
            if len(p) < 10:
                continue
            local, remote, state, queues, inode = p[1], p[2], p[3], p[4], int(p[9])
            if inode:
                rows[inode] = (
                    int(local.rsplit(":", 1)[1], 16),
                    int(remote.rsplit(":", 1)[1], 16),
                    state,
                    int(queues.split(":")[1], 16),
                )
    return rows


def _socket_inodes() -> dict[int, int]:
    """fd -> socket inode, for every descriptor of this process that is a socket now."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found[int(name)] = int(target[8:-1])
    return found


def tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket this process holds a descriptor of (one entry per socket)."""
    table = _table()
    seen: set[int] = set()
    out = []
    for fd, inode in sorted(_socket_inodes().items()):
        row = table.get(inode)
        if row is None or inode in seen:
            continue
        seen.add(inode)
        out.append(TcpSocket(fd, inode, row[0], row[1], row[2], row[3]))
    return out


def listening_ports() -> set[int]:
    return {s.local_port for s in tcp_sockets() if s.state == LISTEN}


@contextlib.contextmanager
def new_listeners() -> Iterator[set[int]]:
    """``with new_listeners() as ports: start_engine()``: afterwards ``ports`` holds the ports of
    the listening sockets this process opened inside the block. One block at a time in the
    process, so engines started by different drivers at once are told apart."""
    ports: set[int] = set()
    with _START_LOCK:
        before = listening_ports() if supported() else set()
        yield ports
        if supported():
            ports.update(listening_ports() - before)


def port_in_blob(port: int, blob: bytes) -> bool:
    """Whether ``blob`` (an engine's published address) names ``port`` in network byte order."""
    return struct.pack(">H", port) in blob


def _unread(fd: int) -> int:
    """Bytes the kernel holds for the engine to read on socket ``fd`` (0 once it cannot tell)."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, "little", signed=True)


def sever(listen_ports: Iterable[int], timeout: float) -> tuple[int, int]:
    """Shut down every established connection accepted on ``listen_ports`` and wait (at most
    ``timeout`` seconds) until the engine has read what the kernel had already queued on them.

    After ``shutdown(SHUT_RDWR)`` the kernel answers any later segment of the connection with a
    reset, so nothing the peer still sends (a retransmission after a partition, the rest of a
    write a stopped process resumes) reaches the engine. Returns (connections severed,
    connections whose queue was still not empty at the deadline: their bytes may still land)."""
    ports = set(listen_ports)
    if not ports or not supported():
        return 0, 0
    held: list[tuple[int, socket.socket]] = []
    try:
        for entry in tcp_sockets():
            if entry.state != ESTABLISHED or entry.local_port not in ports:
                continue
            try:
                dup = os.dup(entry.fd)
            except OSError:
                continue  # closed meanwhile
            if os.fstat(dup).st_ino != entry.inode:
                os.close(dup)  # the engine closed it and the number was reused: not ours to touch
                continue
            sock = socket.socket(fileno=dup)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:
                    raise
            held.append((dup, sock))
        deadline = time.monotonic() + timeout
        pending = [dup for dup, _ in held]
        while pending and time.monotonic() < deadline:
            pending = [dup for dup in pending if _unread(dup) > 0]
            if pending:
                time.sleep(0.001)
        return len(held), len(pending)
    finally:
        for _, sock in held:
            sock.detach()
            # Our duplicate only: the engine's descriptor stays open until the engine closes it.
        for dup, _ in held:
            with contextlib.suppress(OSError):
                os.close(dup)


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if none runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ")".
    rest = stat[stat.rfind(")") + 2 :].split()
    try:
        state, start = rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None
    return None if state in ("Z", "X") else start


def process_alive(pid: int, start: int) -> bool:
    """Whether the process that had pid ``pid`` and started at ``start`` still runs (a zombie
    does not: it writes nothing any more)."""
    return process_start(pid) == start
