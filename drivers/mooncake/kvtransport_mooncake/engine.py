"""One Mooncake ``TransferEngine`` in P2P-handshake mode, set up with its failure modes checked.

Mooncake reports most failures as a bare ``-1`` and explains them only in its log, and some
set-up mistakes crash the process outright (no free port in ``MC_MIN_RPC_PORT`` ..
``MC_MAX_RPC_PORT`` ends in SIGSEGV). This module checks what can be checked before calling
the engine, quotes the engine's log when a call fails, and raises kvtransport errors.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtransport.spi import process_sockets
from kvtransport.spi.diagnose import capture_native_stderr
from kvtransport.spi.driver import MAX_RECEIVE_SIDES
from kvtransport.spi.errors import DriverError, DriverUnavailable, EngineError
from kvtransport.spi.spares import Spares

from .engine_probe import ENV_HOSTNAME, ENV_MAX_BATCH, probe_engine
from .rails import device_filter

_log = logging.getLogger(__name__)

#: Mooncake's own default range for its handshake port, used when the env sets none (or an
#: invalid one, which Mooncake also ignores).
DEFAULT_RPC_PORTS = (15000, 17000)
#: Descriptors per engine batch. Mooncake 0.3.x over TCP rejects a whole batch once it holds
#: more than about 2,000-4,000 descriptors (measured: 2,048 x 32 KiB pass, 4,096 fail).
DEFAULT_MAX_BATCH = 1024
#: Sleep between completion checks of posted requests: from POLL_MIN_S, doubling to POLL_S.
POLL_MIN_S = 0.00001
POLL_S = 0.0002


def max_batch() -> int:
    raw = os.environ.get(ENV_MAX_BATCH, "").strip()
    try:
        value = int(raw) if raw else DEFAULT_MAX_BATCH
    except ValueError:
        value = 0
    if value < 1:
        raise DriverUnavailable(f"{ENV_MAX_BATCH}={raw!r} must be a positive integer")
    return value


def rpc_port_range() -> tuple[int, int]:
    try:
        low = int(os.environ.get("MC_MIN_RPC_PORT", DEFAULT_RPC_PORTS[0]))
        high = int(os.environ.get("MC_MAX_RPC_PORT", DEFAULT_RPC_PORTS[1]))
    except ValueError:
        return DEFAULT_RPC_PORTS
    if not (1024 <= low <= high <= 65535):
        return DEFAULT_RPC_PORTS
    return low, high


def port_problem(host: str, low: int, high: int) -> str:
    """Why Mooncake could not bind its handshake port on ``host`` (empty when it can)."""
    for port in range(low, high + 1):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except socket.gaierror as exc:
                return f"{host!r} does not resolve ({exc}); set {ENV_HOSTNAME} to an address of this host"
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                return f"cannot bind {host}:{port} ({exc}); set {ENV_HOSTNAME} to an address of this host"
            return ""
    return (
        f"no free port for its handshake service in {low}-{high} (MC_MIN_RPC_PORT/MC_MAX_RPC_PORT), "
        "and Mooncake would crash the process trying; free a port or widen the range"
    )


def split_host(value: str) -> str:
    """The host part of ``host`` or ``host:port`` (P2P-handshake mode picks its own port)."""
    if value.startswith("["):
        return value[1 : value.index("]")]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Engine:
    """A started ``TransferEngine`` and the session id peers write to."""

    def __init__(self, driver: str, default_host: str, gpu: int | None = None) -> None:
        """``gpu``: the CUDA device of the KV this engine moves (its nearest RDMA devices are
        the engine's), ``None`` for host memory."""
        facts = probe_engine()
        if not facts.status.available:
            raise DriverUnavailable(f"{driver}: {facts.status.reason}")
        import mooncake.engine

        self.driver = driver
        self.protocol = facts.protocol
        self.host = split_host(os.environ.get(ENV_HOSTNAME, "").strip() or default_host)
        self.max_batch = max_batch()
        low, high = rpc_port_range()
        problem = port_problem(self.host, low, high)
        if problem:
            raise EngineError(f"{driver}: Mooncake cannot start on {self.host}: {problem}")
        self.engine: Any = mooncake.engine.TransferEngine()
        device, why = device_filter(self.protocol, gpu, os.environ)
        if device:
            _log.info("%s: Mooncake on RDMA devices %s (%s)", driver, device, why)
        with process_sockets.new_listeners() as opened, capture_native_stderr() as log:
            rc = self.engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, device)
        if rc != 0:
            on = f", {device!r}" if device else ""
            raise EngineError(
                f"{driver}: Mooncake initialize({self.host!r}, P2PHANDSHAKE, {self.protocol}{on}) returned {rc}: "
                f"{log.tail() or 'no message from the engine'}"
            )
        rpc_port = int(self.engine.get_rpc_port())
        self.session = f"{self.host}:{rpc_port}"
        #: The ports this engine's TCP transport accepts data connections on: the listeners it
        #: opened while it started, in its port range, other than its handshake port.
        self.data_ports = {p for p in opened if low <= p <= high and p != rpc_port}
        #: Every listener it opened: shut down just before it is closed (``close``).
        self.listen_ports = {p for p in opened if low <= p <= high}
        #: A peer was fenced off this engine: its ports stay held after it closes.
        self.fenced = False
        self._registered: list[tuple[int, int]] = []

    def register(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        known = {p for p, _ in self._registered}
        fresh = [(p, n) for p, n in zip(ptrs, lengths, strict=True) if p not in known]
        if not fresh:
            return
        with capture_native_stderr() as log:
            rc = self.engine.batch_register_memory([p for p, _ in fresh], [n for _, n in fresh])
        if rc != 0:
            raise EngineError(
                f"{self.driver}: Mooncake could not register {len(fresh)} regions "
                f"({sum(n for _, n in fresh)} bytes), return code {rc}: {log.tail() or 'no message'}"
            )
        self._registered.extend(fresh)

    def unregister_all(self) -> bool:
        """Withdraw every registration: from here the engine refuses any write a peer sends it
        (Mooncake checks each request against the registered buffers). ``True`` if it did."""
        if not self._registered:
            return True
        with capture_native_stderr():
            rc = self.engine.batch_unregister_memory([p for p, _ in self._registered])
        if rc != 0:
            return False
        self._registered = []
        return True

    def write_polled(
        self,
        session: str,
        src: list[int],
        dst: list[int],
        lengths: list[int],
        window: int,
        stop: threading.Event | None = None,
    ) -> None:
        """Write every descriptor as its own request, at most ``window`` in flight, polling
        completion (oldest first, up to the first still running) with short sleeps; blocks
        until all are written (or, once ``stop`` is set,
        until what was posted has finished), raises on the first failure.

        Mooncake's own batch calls spin a core per waiting caller and reject batches above a
        few thousand descriptors; this does neither."""
        pending: list[int] = []
        i = 0
        nap = POLL_MIN_S
        try:
            while pending or (i < len(src) and not (stop and stop.is_set())):
                while i < len(src) and len(pending) < window and not (stop and stop.is_set()):
                    pending.append(self.post(session, src[i], dst[i], lengths[i]))
                    i += 1
                before = len(pending)
                self.reap(pending)  # on a failure, what it leaves is drained below
                if len(pending) == before:
                    # Nothing finished: back off from a few microseconds (a small write is done
                    # in tens of them) to POLL_S (a large one gains nothing from faster checks).
                    time.sleep(nap)
                    nap = min(nap * 2, POLL_S)
                else:
                    nap = POLL_MIN_S
        finally:
            self.drain(pending)  # never leave posted writes behind a failure

    def reap(self, batches: list[int]) -> None:
        """Drop from the front of ``batches`` the writes that finished, oldest first, up to the
        first one still running: the engine finishes them about in order, and checking every
        one in flight on each pass (up to a window's worth of calls, each releasing and
        retaking the interpreter lock) took the CPU the engine's own threads need. A failed
        write raises, dropped too (``check`` released its id, as it does for finished ones):
        what is left is still posted, for the caller to drain."""
        finished = 0
        try:
            for batch in batches:
                if not self.check(batch):
                    break
                finished += 1
        except EngineError:
            finished += 1
            raise
        finally:
            del batches[:finished]

    def drain(self, batches: list[int], timeout: float = 30.0) -> None:
        """Wait (polling, up to ``timeout`` each) until posted writes have finished, whatever
        their outcome: Mooncake cannot cancel them, and its batch ids are released by the
        check that sees them end."""
        for batch in batches:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if self.check(batch):
                        break
                except EngineError:
                    break
                time.sleep(POLL_S)

    def post(self, session: str, src: int, dst: int, length: int) -> int:
        """Start one write and return its batch id; never waits."""
        batch = int(self.engine.transfer_submit_write(session, src, dst, length))
        if batch <= 0:
            raise EngineError(
                f"{self.driver}: Mooncake refused a {length}-byte write to {session} over {self.protocol} "
                f"(transfer_submit_write returned {batch}); the engine's log (stderr) has the cause"
            )
        return batch

    def check(self, batch: int) -> bool:
        """Whether a single-write batch from :meth:`post` completed; raises if it failed.

        ``transfer_check_status`` looks at the batch's first request only, which is the whole
        batch here: :meth:`post` submits one request per batch.
        """
        status = int(self.engine.transfer_check_status(batch))
        if status == 0:
            return False
        if status == 1:
            return True
        raise EngineError(
            f"{self.driver}: a Mooncake write over {self.protocol} "
            f"{'timed out' if status == -2 else 'failed'} (status {status}); the engine's log (stderr) has the cause"
        )

    def close(self) -> None:
        if self._registered:
            try:
                self.engine.batch_unregister_memory([p for p, _ in self._registered])
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._registered = []
        # Mooncake's handshake thread waits in accept() with a 1 s timeout, and its destructor
        # joins it holding the interpreter lock: every thread of the process stalled 0.9 s per
        # engine closed (measured). Its listeners shut down first, accept returns at once (1 ms).
        # Between the two its accept fails and logs each try: that millisecond's log is dropped.
        if self.engine is not None:
            with capture_native_stderr(echo=False):
                process_sockets.stop_listening(self.listen_ports)
                self.engine = None


@dataclass
class _Fenced:
    """A fenced receive engine and how far its fence got."""

    engine: Engine
    since: float
    unregistered: bool = False


class Receivers:
    """The engines peers write into, one per peer (``receive_info``), and their fences.

    Mooncake cannot refuse one peer's writes while it accepts another's: its TCP transport
    writes whatever a connection carries into any registered buffer, and reconnects on its own
    with writes still queued. So each peer gets an engine of its own with this endpoint's
    receiving memory (``memory()``: pointers and lengths) registered, and :meth:`fence`
    withdraws those registrations (Mooncake then refuses every request of the peer, new
    connections included; over RDMA the NIC refuses its memory keys), severs the engine's
    connections and waits until it has read what the kernel had queued. A fenced engine is kept
    (at most ``MAX_FENCED``, for at most ``FENCED_KEEP_S``) so that its port cannot go to
    another engine while the peer might still reconnect to it; past that its ports stay taken by
    a socket that does not listen (``MAX_PLACEHOLDERS``), so a peer that comes back later is
    refused instead of reaching another peer's engine. Engines are made ahead and closed behind
    on a thread of their own (``spi.spares``: closing one takes Mooncake a second)."""

    MAX_FENCED = 32
    FENCED_KEEP_S = 1800.0
    MAX_PLACEHOLDERS = 256

    def __init__(
        self,
        driver: str,
        host: str | Callable[[], str],
        memory: Callable[[], tuple[list[int], list[int]]],
        gpu: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.driver = driver
        self._host = host
        self._gpu = gpu  # the CUDA device of the KV, read when an engine is made
        self._memory = memory
        self._live: dict[str, Engine] = {}
        self._fenced: collections.OrderedDict[str, _Fenced] = collections.OrderedDict()
        self._placeholders: collections.OrderedDict[int, socket.socket] = collections.OrderedDict()
        self._lock = threading.Lock()  # the placeholders: held from the spares' thread too
        # None made ahead (one takes milliseconds), one unused kept: closing one costs the whole
        # process 0.9 s (it holds the interpreter lock), so closes are kept rare.
        self._spares: Spares[Engine] = Spares(f"{driver}-receive", self._make, self._retire, keep=0, hold=1)

    @property
    def host(self) -> str:
        """Where the engines listen (the endpoint's host, read when first needed)."""
        return self._host if isinstance(self._host, str) else self._host()

    def sessions(self) -> set[str]:
        return {e.session for e in self._live.values()}

    def _make(self) -> Engine:
        engine = Engine(self.driver, self.host, self._gpu())
        try:
            engine.register(*self._memory())
        except BaseException:
            engine.close()
            raise
        if not engine.data_ports and engine.protocol == "tcp" and process_sockets.supported():
            _log.warning("%s: cannot tell which port a receive engine listens on", self.driver)
        return engine

    def _retire(self, engine: Engine) -> None:
        """Close ``engine`` (on the spares' thread); a fenced one leaves its ports held."""
        ports = engine.data_ports if engine.fenced else set()
        engine.close()
        for port in sorted(ports):
            self._hold_port(port)

    def create(self, peer: str) -> Engine:
        """An engine for ``peer`` alone (a ready one, or one made now)."""
        self._prune()
        if len(self._live) >= MAX_RECEIVE_SIDES and peer not in self._live:
            raise DriverError(f"{self.driver}: {MAX_RECEIVE_SIDES} peers already have a receive engine of their own")
        engine = self._spares.take()
        old = self._live.pop(peer, None)
        if old is not None:
            self._spares.release(old)
        self._live[peer] = engine
        return engine

    def fence(self, peer: str, timeout: float) -> bool:
        """No byte of ``peer`` can land any more (``True``), or this cannot be promised yet: it
        wrote into an endpoint-wide engine, the registrations could not be withdrawn, the
        engine's connections cannot be found, or one still holds unread bytes. Each ask redoes
        what is missing (and severs connections made since)."""
        record = self._fenced.get(peer)
        if record is None:
            engine = self._live.pop(peer, None)
            if engine is None:
                return False
            engine.fenced = True
            record = self._fenced[peer] = _Fenced(engine, time.monotonic())
            self._prune()
        engine = record.engine
        if not record.unregistered:
            record.unregistered = engine.unregister_all()
            if not record.unregistered:
                _log.warning("%s: the receive engine for %s kept its registrations", self.driver, peer)
                return False
        if engine.protocol != "tcp":
            return True  # RDMA: the registrations (and with them the peer's memory keys) are gone
        if not engine.data_ports:
            return False  # its connections cannot be found: bytes already queued may still land
        severed, unread = process_sockets.sever(engine.data_ports, timeout)
        if unread:
            _log.warning("%s: %d severed connections of %s still held unread bytes", self.driver, unread, peer)
            return False
        _log.debug("%s: fenced %s (%d connections severed)", self.driver, peer, severed)
        return True

    def drop(self, peer: str) -> None:
        """``peer`` never wrote into its engine (another driver was chosen, or the handshake
        failed): it serves the next connection. A fenced one stays."""
        engine = self._live.pop(peer, None)
        if engine is not None:
            self._spares.give_back(engine)

    def close(self) -> None:
        """Every engine closed (in parallel), the held ports let go."""
        engines = [*self._live.values(), *(f.engine for f in self._fenced.values())]
        for engine in engines:
            engine.fenced = False  # no port held past the endpoint
        self._live.clear()
        self._fenced.clear()
        self._spares.stop(engines)
        with self._lock:
            for placeholder in self._placeholders.values():
                placeholder.close()
            self._placeholders.clear()

    def _prune(self) -> None:
        now = time.monotonic()
        while self._fenced:
            peer, record = next(iter(self._fenced.items()))
            if len(self._fenced) <= self.MAX_FENCED and now - record.since < self.FENCED_KEEP_S:
                break
            del self._fenced[peer]
            self._spares.release(record.engine)

    def _hold_port(self, port: int) -> None:
        """Keep ``port`` from any other engine: bound, not listening (a peer that reconnects is
        refused). Best effort: another socket may have taken it the moment the engine let go."""
        holder = None
        for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
            candidate = socket.socket(family)
            try:
                candidate.bind((address, port))  # every address: no engine may listen on it
            except OSError:
                candidate.close()
                continue
            holder = candidate
            break
        if holder is None:
            return
        with self._lock:
            self._placeholders[port] = holder
            while len(self._placeholders) > self.MAX_PLACEHOLDERS:
                _, oldest = self._placeholders.popitem(last=False)
                oldest.close()
