"""This process's TCP sockets, and whether a peer process still runs: what drivers need to fence.

A one-sided engine (Mooncake over TCP, UCX over TCP) writes whatever arrives on its data
connections into registered memory; the engine itself offers no call that stops one peer's
bytes. What the operating system offers is the connection: ``shutdown(2)`` on our end of it
makes the kernel refuse any later segment of it (the peer gets a reset, and nothing more reaches
the engine), and the bytes already queued in the kernel are either read by the engine (they were
sent before the fence) or discarded with the socket. This module finds such sockets by walking
this process's own descriptors (never the namespace-wide ``/proc/net/tcp``, which a busy host
makes long, and which forgets a reset socket whose unread bytes the engine can still read):

- :func:`tcp_sockets` lists the process's TCP sockets, each once: a descriptor, its local and
  remote ports, whether it listens;
- :func:`new_listeners` names the listening sockets an engine opened while it started (taken
  under one process-wide lock, so two engines starting at once do not see each other's);
- :func:`sever` shuts down every connection accepted on given listening ports, whatever its
  state (established, or half-closed with bytes still unread), through a duplicate of the
  descriptor checked to be that socket (a descriptor number the engine closed and reused
  meanwhile is left alone), and can wait until the engine has read what the kernel had queued.

An engine that writes into a peer's memory without any connection of the receiver's (UCX's
cross-memory attach between processes of one host, CUDA IPC) cannot be fenced by the receiver
at all: only the writer's end stops it. :func:`process_start` and :func:`process_alive` tell a
driver whether that process (identified by pid and start time, so a reused pid is not mistaken
for it) still runs, and :func:`kernel_and_pid_namespace` whether it could be one this process
shares a kernel and a PID namespace with (what cross-memory attach needs).

Linux only (``/proc``); elsewhere :func:`supported` is ``False`` and drivers say they cannot
fence. Nothing here imports an engine, and nothing here raises for a socket that vanished.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
import termios
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

#: Held while an engine starts and its new listeners are read (:func:`new_listeners`).
_START_LOCK = threading.Lock()


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process: a descriptor that refers to it, and its ports."""

    fd: int
    inode: int
    local_port: int
    remote_port: int
    listening: bool


def supported() -> bool:
    """Whether this platform lets a driver list and sever its engine's connections."""
    return os.path.isdir("/proc/self/fd")


def _socket_fds() -> dict[int, int]:
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


@contextlib.contextmanager
def _borrowed(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A socket object over a duplicate of ``fd``, if ``fd`` still is socket ``inode`` (the
    engine may have closed it and the number gone to something else); the duplicate is closed
    afterwards, the engine's descriptor never touched."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        info = os.fstat(dup)
        if not stat.S_ISSOCK(info.st_mode) or info.st_ino != inode:
            yield None
            return
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            yield None
            return
        try:
            yield sock
        finally:
            sock.detach()
    finally:
        with contextlib.suppress(OSError):
            os.close(dup)


def tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket this process holds a descriptor of (one entry per socket)."""
    out: list[TcpSocket] = []
    seen: set[int] = set()
    for fd, inode in sorted(_socket_fds().items()):
        if inode in seen:
            continue
        with _borrowed(fd, inode) as sock:
            if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                local = sock.getsockname()[1]
                listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            except OSError:
                continue
            try:
                remote = sock.getpeername()[1]
            except OSError:
                remote = 0  # listening, or no longer connected (a reset socket may still hold bytes)
            seen.add(inode)
            out.append(TcpSocket(fd, inode, int(local), int(remote), listening))
    return out


def listening_ports() -> set[int]:
    return {s.local_port for s in tcp_sockets() if s.listening}


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


def stop_listening(ports: Iterable[int]) -> int:
    """Shut down this process's listening sockets on ``ports`` (an engine about to be closed:
    its accept loop returns at once instead of at its next timeout). Returns how many."""
    wanted = set(ports)
    stopped = 0
    for entry in tcp_sockets():
        if not entry.listening or entry.local_port not in wanted:
            continue
        with _borrowed(entry.fd, entry.inode) as sock:
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                stopped += 1
    return stopped


def port_in_blob(port: int, blob: bytes) -> bool:
    """Whether ``blob`` (an engine's published address) names ``port`` in network byte order."""
    return struct.pack(">H", port) in blob


def _unread(sock: socket.socket) -> int:
    """Bytes the kernel holds for the engine to read on ``sock`` (0 once it cannot tell)."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, "little", signed=True)


def sever(listen_ports: Iterable[int], timeout: float) -> tuple[int, int]:
    """Shut down every connection accepted on ``listen_ports`` (any state: established, or
    half-closed or reset with bytes still unread) and wait, at most ``timeout`` seconds (0: not
    at all), until the engine has read what the kernel had already queued on them.

    After ``shutdown(SHUT_RDWR)`` the kernel answers any later segment of the connection with a
    reset, so nothing the peer still sends (a retransmission after a partition, the rest of a
    write a stopped process resumes) reaches the engine. Returns (connections severed,
    connections whose queue was still not empty at the deadline: their bytes may still land if
    the engine reads them). Never raises."""
    ports = set(listen_ports)
    if not ports or not supported():
        return 0, 0
    held: list[tuple[int, int]] = []
    for entry in tcp_sockets():
        if entry.listening or entry.local_port not in ports:
            continue
        with _borrowed(entry.fd, entry.inode) as sock:
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError as exc:
                if exc.errno not in (errno.ENOTCONN, errno.EINVAL):
                    continue
            held.append((entry.fd, entry.inode))
    deadline = time.monotonic() + timeout
    pending = list(held)
    while pending:
        still = []
        for fd, inode in pending:
            with _borrowed(fd, inode) as sock:
                if sock is not None and _unread(sock) > 0:
                    still.append((fd, inode))
        pending = still
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.001)
    return len(held), len(pending)


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if none runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ")".
    rest = text[text.rfind(")") + 2 :].split()
    try:
        state, start = rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None
    return None if state in ("Z", "X") else start


def process_alive(pid: int, start: int) -> bool:
    """Whether the process that had pid ``pid`` and started at ``start`` still runs (a zombie
    does not: it writes nothing any more)."""
    return process_start(pid) == start


def kernel_and_pid_namespace() -> str:
    """This kernel's boot and this process's PID namespace: equal for two processes that can
    reach each other's memory by pid (cross-memory attach), whatever their host names."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}"


#: A process as a connection info names it: (kernel and PID namespace, pid, start time).
Identity = tuple[str, int, int]


def identity() -> dict[str, Any]:
    """What a driver's connection info says of this process, so that a peer can tell when it
    has ended (:func:`identity_in`, :func:`process_alive`)."""
    pid = os.getpid()
    return {"ns": kernel_and_pid_namespace(), "pid": pid, "start": process_start(pid) or 0}


def identity_in(doc: Mapping[str, Any]) -> Identity | None:
    """The process a peer's connection info names (see :func:`identity`), if it names one."""
    ns, pid, start = doc.get("ns"), doc.get("pid"), doc.get("start")
    if isinstance(ns, str) and ns and isinstance(pid, int) and isinstance(start, int):
        return ns, pid, start
    return None


def may_copy_into_us(process: Identity | None) -> bool:
    """Whether ``process`` shares this kernel and PID namespace: it could then write into this
    process's memory by cross-memory attach (or CUDA IPC), which no receiver can stop."""
    return process is not None and process[0] == kernel_and_pid_namespace()


def ended(process: Identity) -> bool:
    return not process_alive(process[1], process[2])
