"""One Mooncake ``TransferEngine`` in P2P-handshake mode, set up with its failure modes checked.

Mooncake reports most failures as a bare ``-1`` and explains them only in its log, and some
set-up mistakes crash the process outright (no free port in ``MC_MIN_RPC_PORT`` ..
``MC_MAX_RPC_PORT`` ends in SIGSEGV). This module checks what can be checked before calling
the engine, quotes the engine's log when a call fails, and raises kvtransport errors.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvtransport.spi.diagnose import capture_native_stderr
from kvtransport.spi.errors import DriverUnavailable, EngineError

from .engine_probe import ENV_DEVICE, ENV_HOSTNAME, ENV_MAX_BATCH, probe_engine

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

    def __init__(self, driver: str, default_host: str) -> None:
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
        device = os.environ.get(ENV_DEVICE, "")
        with capture_native_stderr() as log:
            rc = self.engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, device)
        if rc != 0:
            raise EngineError(
                f"{driver}: Mooncake initialize({self.host!r}, P2PHANDSHAKE, {self.protocol}) returned {rc}: "
                f"{log.tail() or 'no message from the engine'}"
            )
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        fresh = [(p, n) for p, n in zip(ptrs, lengths, strict=True) if p not in self._registered]
        if not fresh:
            return
        with capture_native_stderr() as log:
            rc = self.engine.batch_register_memory([p for p, _ in fresh], [n for _, n in fresh])
        if rc != 0:
            raise EngineError(
                f"{self.driver}: Mooncake could not register {len(fresh)} regions "
                f"({sum(n for _, n in fresh)} bytes), return code {rc}: {log.tail() or 'no message'}"
            )
        self._registered.extend(p for p, _ in fresh)

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
                self.engine.batch_unregister_memory(self._registered)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._registered = []
        self.engine = None
