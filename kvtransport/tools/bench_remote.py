"""``kvtransport bench --listen`` / ``--connect``: the bench's decode side on another host.

``--listen HOST:PORT`` serves decode processes: a client connects over TCP, sends one line
(the token and the :mod:`kvtransport.tools.peer` arguments it wants), and the listener starts that
peer with the connection as its stdin and stdout, so the client then speaks the same
JSON-lines protocol it speaks to a local child. The peer's endpoint listens on the address the
client reached, so the prefill side's engines can reach it. ``--connect HOST:PORT`` makes the
bench use such peers (:class:`RemotePeer`) instead of local children.

The two hosts' clocks are not compared directly: a decode side reports when each request
reached Success on its own monotonic clock, and the client maps that onto its clock with the
offset measured at connect (the probe with the shortest round trip of several, NTP-style; the
error is at most half that round trip, which the report gives).

The listener is a benchmark tool for a network you trust: it takes only the arguments that
describe a KV pool, caps the pool's size, refuses a client without the token, and runs at most
``max_sessions`` peers at once.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtransport.runtime.bounded import ConnectionQuota
from kvtransport.spi.errors import ConfigError, KVTransportError

log = logging.getLogger(__name__)

TOKEN_ENV = "KVTRANSPORT_BENCH_TOKEN"
#: The longest first line a client may send (token and arguments), and how long it may take.
MAX_REQUEST = 16 << 10
REQUEST_TIMEOUT_S = 5.0
#: Connections that may be sending their request at once, in all and from one address.
MAX_UNPROVEN = 32
MAX_UNPROVEN_PER_HOST = 4
#: The shortest token a listener accepts (a short one could be guessed online).
MIN_TOKEN = 16
#: Bounds of a pool's shape beyond its bytes: regions cost a mapping each.
MAX_REGIONS = 4096
MAX_PAGE_TOKENS = 4096
#: The peer arguments a client may pass: those that shape a KV pool, nothing else.
VALUED = {"--driver", "--pages", "--layers", "--item", "--aux-slots", "--name", "--page-tokens", "--state"}
FLAGS = {"--private", "--mla"}


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdecimal() or not (0 <= int(port) < 65536):
        raise ConfigError(f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


#: Bounds of the integers a client may pass (a count of pages, layers, bytes of an item).
MAX_INT = 1 << 40


def checked_args(args: Any, max_pool_bytes: int) -> list[str]:
    """The client's peer arguments, or :class:`ConfigError` naming what is not allowed: only
    the flags that shape a pool, each integer in range, the whole pool (KV, aux and state)
    within ``max_pool_bytes``."""
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError("args must be a list of strings")
    out: list[str] = []
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in FLAGS:
            out.append(flag)
            i += 1
        elif flag in VALUED and i + 1 < len(args):
            values[flag] = args[i + 1]
            out += [flag, args[i + 1]]
            i += 2
        else:
            raise ConfigError(f"peer argument {flag!r} is not allowed here")

    def count(flag: str, default: int, low: int = 1) -> int:
        text = values.get(flag, str(default))
        if not (text.isascii() and text.isdecimal()) or not low <= int(text) <= MAX_INT:
            raise ConfigError(f"{flag} {text!r} must be an integer from {low} to {MAX_INT}")
        return int(text)

    if values.get("--driver", "fake").startswith("fake"):
        # The test drivers map files the far side names: never for a stranger's peer.
        raise ConfigError("--driver must name a real driver (or auto) here")
    layers = count("--layers", 4)
    size = count("--pages", 256) * layers * count("--item", 4096)
    size += count("--aux-slots", 8, low=0) * 64
    if count("--page-tokens", 16) > MAX_PAGE_TOKENS:
        raise ConfigError(f"--page-tokens must be at most {MAX_PAGE_TOKENS}")
    try:
        state = json.loads(values.get("--state", "[]"))
        groups = [[int(x) for x in g] for g in state if all(type(x) is int for x in g) and len(g) == 3]
        if not isinstance(state, list) or len(groups) != len(state):
            raise ValueError("not a list of [items, item_len, buffers] integers")
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(f"--state is malformed: {exc}") from None
    for group in groups:
        if not all(1 <= x <= MAX_INT for x in group):
            raise ConfigError(f"--state group {group} must hold integers from 1 to {MAX_INT}")
        size += group[0] * group[1] * group[2]
    if layers + sum(g[2] for g in groups) > MAX_REGIONS:
        raise ConfigError(f"at most {MAX_REGIONS} KV and state buffers")
    if size > max_pool_bytes:
        raise ConfigError(f"the pool asked for ({size >> 20} MiB) exceeds this listener's {max_pool_bytes >> 20} MiB")
    # Always private memory: a pool in /dev/shm would outlive a peer killed at close.
    return out if "--private" in out else [*out, "--private"]


def listen_url(host: str) -> str:
    """``tcp://host:0`` for an endpoint to listen on, IPv6 hosts bracketed."""
    return f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"


class Listener:
    """Serves decode peers to bench clients, one process per client connection."""

    def __init__(self, address: str, token: str, *, max_sessions: int = 16, max_pool_bytes: int = 8 << 30) -> None:
        if len(token) < MIN_TOKEN:
            raise ConfigError(
                f"a bench listener needs a token of at least {MIN_TOKEN} characters "
                "(KVTRANSPORT_BENCH_TOKEN, or leave it unset for a generated one)"
            )
        host, port = parse_address(address)
        self.token = token
        self.max_sessions = max_sessions
        self.max_pool_bytes = max_pool_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, reuse_port=False)
        self.sock.settimeout(0.2)
        self.address = "{}:{}".format(*self.sock.getsockname()[:2])
        self._children: list[subprocess.Popen[bytes]] = []
        self._reserved = 0  # sessions past the token check whose peer is being started
        self._lock = threading.Lock()
        #: Notified whenever a session gives back its reservation (``close`` waits for none).
        self._settled = threading.Condition(self._lock)
        #: Connections that have not yet sent their request: a stranger cannot hold more.
        self._unproven = ConnectionQuota(MAX_UNPROVEN, MAX_UNPROVEN_PER_HOST)
        self.stop = threading.Event()

    def serve(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    self._reap()
                    continue
                except OSError as exc:
                    if self.stop.is_set():  # closed from another thread
                        break
                    # Out of descriptors or memory: the peers running keep running.
                    log.warning("bench listener: accept failed (%s); retrying", exc)
                    time.sleep(0.5)
                    continue
                source = _host_of(conn)
                if not self._unproven.admit(source):
                    _refuse(conn, "busy: too many connections still owe their request; try again")
                    continue
                try:
                    threading.Thread(target=self._session, args=(conn, source), daemon=True).start()
                except RuntimeError:
                    self._unproven.release(source)
                    conn.close()
        finally:
            self.close()

    def _reap(self) -> None:
        with self._lock:
            self._children = [c for c in self._children if c.poll() is None]

    @property
    def peers(self) -> int:
        """Decode processes running or being started now (those whose client left are reaped)."""
        self._reap()
        with self._lock:
            return len(self._children) + self._reserved

    def _session(self, conn: socket.socket, source: str) -> None:
        reserved = False
        try:
            try:
                request = _read_line(conn, time.monotonic() + REQUEST_TIMEOUT_S)
            finally:
                self._unproven.release(source)  # its request is in, or it gave up
            msg = json.loads(request)
            if not isinstance(msg, dict) or not hmac.compare_digest(
                str(msg.get("token", "")).encode(), self.token.encode()
            ):
                raise ConfigError("wrong or missing token (set KVTRANSPORT_BENCH_TOKEN to the listener's)")
            args = checked_args(msg.get("args"), self.max_pool_bytes)
            self._reap()
            with self._lock:
                if self.stop.is_set() or len(self._children) + self._reserved >= self.max_sessions:
                    raise ConfigError(f"this listener already runs {self.max_sessions} peers")
                self._reserved += 1
                reserved = True
            # The peer listens where this client reached us, so the client's engines reach it.
            here, client = conn.getsockname()[0], conn.getpeername()[0]
            _keepalive(conn)  # a client whose host vanished must not hold its peer for ever
            conn.settimeout(None)
            child = subprocess.Popen(
                [sys.executable, "-m", "kvtransport.tools.peer", *args, "--listen", listen_url(here)],
                stdin=conn.fileno(),
                stdout=conn.fileno(),
            )
            with self._lock:
                self._children.append(child)
                self._reserved -= 1
                reserved = False
                self._settled.notify_all()
                late = self.stop.is_set()
            if late:
                child.terminate()
            log.info("bench peer %d started for %s", child.pid, client)
        except Exception as exc:  # noqa: BLE001 - whatever a client sent, the listener goes on
            try:
                conn.sendall((json.dumps({"error": type(exc).__name__, "message": str(exc)}) + "\n").encode())
            except OSError:
                pass
        finally:
            if reserved:
                with self._lock:
                    self._reserved -= 1
                    self._settled.notify_all()
            conn.close()  # the child holds its own copy

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        with self._lock:
            # A session past the token check may be starting its peer: let it finish, so that
            # peer is in the list below (no new one starts once ``stop`` is set).
            self._settled.wait_for(lambda: self._reserved == 0, timeout=10)
            children, self._children = self._children, []
        for c in children:
            c.terminate()
        for c in children:
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()


def _keepalive(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _host_of(conn: socket.socket) -> str:
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "?"


def _refuse(conn: socket.socket, why: str) -> None:
    try:
        conn.setblocking(False)
        conn.send((json.dumps({"error": "ConfigError", "message": why}) + "\n").encode())
    except OSError:
        pass
    conn.close()


def _read_line(conn: socket.socket, deadline: float) -> str:
    """One line, all of it before ``deadline``. Nothing after it may be taken from the
    socket (the child reads the rest), so each read peeks first and then takes only up to the
    newline."""
    data = bytearray()
    while len(data) < MAX_REQUEST:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConfigError(f"no request within {REQUEST_TIMEOUT_S:.0f} s")
        conn.settimeout(left)
        seen = conn.recv(min(4096, MAX_REQUEST - len(data)), socket.MSG_PEEK)
        if not seen:
            raise ConfigError("the client closed before its request")
        end = seen.find(b"\n")
        taken = conn.recv(len(seen) if end < 0 else end + 1)
        data += taken
        if data.endswith(b"\n"):
            return data[:-1].decode()
    raise ConfigError(f"request longer than {MAX_REQUEST} bytes")


class RemotePeer:
    """A decode peer served by a :class:`Listener`: the :class:`~kvtransport.tools.peer_process.PeerProcess`
    interface over TCP."""

    def __init__(self, address: str, args: list[str], token: str, timeout: float = 60.0) -> None:
        host, port = parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        #: This host's address on the route to the listener: where the prefill side listens.
        self.local_host = self.sock.getsockname()[0]
        self._file = self.sock.makefile("rb")
        self.clock_offset, self.clock_error = 0.0, 0.0
        try:
            self.sock.sendall((json.dumps({"token": token, "args": args}) + "\n").encode())
            hello = self._read(timeout)
            if "error" in hello:
                raise KVTransportError(f"bench listener at {address} refused: {hello.get('message', '')}")
            self.address: str = str(hello["address"])
            self.name: str = str(hello["name"])
        except BaseException:
            self._release()
            raise

    def _read(self, timeout: float) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        while True:
            try:
                line = self._file.readline()
            except TimeoutError:
                raise TimeoutError(f"remote peer gave no answer within {timeout} s") from None
            if not line:
                raise RuntimeError("remote peer closed the connection")
            if line.startswith(b"{"):  # native libraries may print other lines
                result: dict[str, Any] = json.loads(line)
                return result

    def call(self, cmd: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        self.sock.sendall((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
        result = self._read(timeout)
        if "error" in result and cmd != "close":
            raise RuntimeError(f"remote peer {cmd} failed: {result['error']}: {result['message']}")
        return result

    def measure_clock(self, probes: int = 9) -> float:
        """The peer's monotonic clock minus ours, from the probe with the shortest round trip;
        ``clock_error`` gets half that round trip (the bound on the offset's error)."""
        best = None
        for _ in range(probes):
            t0 = time.monotonic()
            there = float(self.call("cpu", timeout=10)["now"])
            t1 = time.monotonic()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, there - (t0 + t1) / 2)
        assert best is not None
        self.clock_error, self.clock_offset = best[0] / 2, best[1]
        return self.clock_offset

    def close(self) -> None:
        try:
            self.call("close", timeout=10)
        except (OSError, RuntimeError, TimeoutError, ValueError):
            pass
        self._release()

    def _release(self) -> None:
        for f in (self._file, self.sock):
            try:
                f.close()
            except OSError:
                pass


def remote_peers(address: str, timeout: float) -> Callable[[list[str]], RemotePeer]:
    """What ``--connect HOST:PORT`` starts decode sides with: peers served by the listener
    there, under the token in ``KVTRANSPORT_BENCH_TOKEN``."""
    token = token_from_env()
    return lambda args: RemotePeer(address, args, token, timeout)


def token_from_env() -> str:
    return os.environ.get(TOKEN_ENV, "")


def new_token() -> str:
    return secrets.token_hex(16)
