"""The endpoint's side of its drivers: opening and closing them, the context each driver
instance gets (:class:`EndpointContext`), and what drivers report from their own threads or
need while bytes arrive (:class:`DriverTraffic`: notices for peers, the check of inbound data
against what was announced, ``progress()`` calls while a receive transfer lasts).

The endpoint (``runtime.endpoint.Endpoint``) satisfies :class:`DriverHost` and
:class:`TrafficHost`; this module imports nothing of it.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from kvtransport.negotiation.hello import DriverHello
from kvtransport.negotiation.registry import Policy
from kvtransport.runtime.control import ControlChannel
from kvtransport.runtime.lane import connection_of
from kvtransport.runtime.runner import DriverRunner
from kvtransport.runtime.session import Phase, Session
from kvtransport.runtime.wire import encode
from kvtransport.spi.driver import DriverStatus, KVTransport
from kvtransport.spi.errors import InvalidPages, KVTransportError
from kvtransport.spi.inbound import Pieces
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import only_ints

log = logging.getLogger(__name__)


class DriverHost(Protocol):
    """What opening the drivers, and each driver's context, need of the endpoint."""

    name: str
    host: str
    regions: RegionSet
    policy: Policy

    @property
    def classes(self) -> Mapping[str, type[KVTransport]]: ...

    @property
    def runners(self) -> Mapping[str, DriverRunner]: ...

    def queue_notice(self, peer: str, payload: bytes, driver: str = "") -> None: ...

    def check_inbound(self, peer: str, dst: Any, length: Any) -> bool: ...


class EndpointContext:
    """What a driver instance gets from its endpoint (see ``DriverContext``)."""

    def __init__(self, endpoint: DriverHost, name: str, options: Mapping[str, str]) -> None:
        self._endpoint = endpoint
        self._name = name
        self._options = dict(options)

    @property
    def endpoint_id(self) -> str:
        return self._endpoint.name

    @property
    def options(self) -> Mapping[str, str]:
        return self._options

    @property
    def host(self) -> str:
        return self._endpoint.host

    def send_notice(self, peer: str, payload: bytes) -> None:
        self._endpoint.queue_notice(peer, payload, self._name)

    def completed(self, handle: int) -> None:
        runner = self._endpoint.runners.get(self._name)
        if runner is not None:
            runner.signal(("batch", handle))

    def inbound_progress(self, peer: str) -> None:
        runner = self._endpoint.runners.get(self._name)
        if runner is not None:
            runner.signal_prefix(("inbound", peer))

    def check_inbound(self, peer: str, dst: Pieces, length: Pieces) -> bool:
        return self._endpoint.check_inbound(peer, dst, length)


def open_drivers(
    endpoint: DriverHost,
    hellos: Mapping[str, DriverHello],
    options: Mapping[str, str],
    opened: dict[str, KVTransport],
) -> dict[str, DriverHello]:
    """Register the regions with every driver that can serve them, once each, each into
    ``opened`` as it opens (a caller that fails later closes what is there). Returns each
    driver's entry of ``hellos``, opened or with why not."""
    entries: dict[str, DriverHello] = {}
    memory = endpoint.regions.kv_kind
    for name, entry in hellos.items():
        cls = endpoint.classes.get(name)
        allowed, _ = endpoint.policy.permits(name)
        if cls is None or entry.status is None or not entry.status.serves(memory) or not allowed:
            entries[name] = entry
            continue
        driver: KVTransport | None = None
        try:
            driver = cls(EndpointContext(endpoint, name, options))
            conn = driver.open(endpoint.regions)
        except Exception as exc:
            if isinstance(exc, KVTransportError):
                log.warning("driver %s could not open this endpoint's regions: %s", name, exc)
                reason = f"open() failed: {exc}"
            else:
                log.exception("driver %s crashed in open()", name)
                reason = f"open() raised {type(exc).__name__}: {exc}"
            entries[name] = _unavailable(entry, reason)
            if driver is not None:
                _close_quietly(name, driver)
            continue
        except BaseException:  # interrupted: the caller's cleanup knows only the opened ones
            if driver is not None:
                _close_quietly(name, driver)
            raise
        opened[name] = driver
        entries[name] = DriverHello(
            name, entry.distribution, entry.api_version, entry.capabilities, entry.status, "", conn
        )
    return entries


def close_drivers(runners: Mapping[str, DriverRunner], drivers: Mapping[str, KVTransport]) -> None:
    """Stop every runner, then close every driver (a failure is logged, never raised)."""
    for name, runner in list(runners.items()):
        if not runner.stop():
            log.warning("driver %s: its thread is still inside the engine; closing it anyway", name)
    for name, driver in list(drivers.items()):
        _close_quietly(name, driver)


def pending_handles(driver: KVTransport) -> int:
    try:
        return int(driver.pending())
    except Exception:  # noqa: BLE001 - diagnostics only
        return -1


class TrafficHost(Protocol):
    """What :class:`DriverTraffic` needs of the endpoint: its channel, its message size limit
    and its sessions by id."""

    channel: ControlChannel
    max_message_bytes: int

    @property
    def sessions(self) -> Mapping[str, Session]: ...


class DriverTraffic:
    """Notices drivers send their peers, queued for the I/O thread; the check of a peer's
    inbound data against the pages announced to it; and the receiving drivers' ``progress()``."""

    def __init__(self, endpoint: TrafficHost) -> None:
        self._endpoint = endpoint
        self._notices: collections.deque[tuple[str, bytes]] = collections.deque()
        #: driver -> live receive transfers (I/O thread)
        self.receiving_now: dict[str, int] = {}

    # -- any thread --------------------------------------------------------------------------

    def queue_notice(self, peer: str, payload: bytes, driver: str = "") -> None:
        # Queued in order; the I/O thread flushes the queue before it sends any "done", so a
        # notice a driver sent before reporting a batch complete always reaches the peer before
        # the "done" that follows that batch.
        # In ordered mode (runtime.ordered) it goes out right here, on the express stream,
        # which carries that "done" too, behind it.
        session = self._endpoint.sessions.get(peer)
        lane = session.wire_name(driver) if session is not None else ""
        if session is not None and session.order.hold_notice(lane, payload):
            return  # the thread that submitted its batch sends it, in that transfer's "done"
        data = encode("notice", self._endpoint.max_message_bytes, payload=payload, lane=lane)
        if session is not None:
            order = session.order
            with order.lock:
                ordered = order.link is not None
                if not ordered:
                    self._notices.append((peer, data))
            if ordered:
                order.send(data)
                return
        else:
            self._notices.append((peer, data))
        if self._endpoint.channel.in_io_thread():
            self.flush_notices()
        else:
            self._endpoint.channel.call_soon(self.flush_notices)

    def check_inbound(self, peer: str, dst: Any, length: Any) -> bool:
        """Driver thread: ``True`` when every piece lands in pages announced to ``peer``;
        ``False`` for late data of a transfer of ``peer`` that failed (drop it); raises
        :class:`InvalidPages` otherwise. Lists of ints are checked as they are (a small
        chunk's), anything else as uint64 arrays."""
        dst, length = inbound_pieces(dst), inbound_pieces(length)
        # (a lane back from quarantine knows the peer by a key of its own: ``lane.generation_key``)
        session = self._endpoint.sessions.get(connection_of(peer))
        if session is None or session.phase is not Phase.READY:
            raise InvalidPages(f"inbound data from {peer!r}, which is not connected")
        guard = session.guard
        if guard is None:
            raise InvalidPages(f"inbound data from {session.peer_label}, which was announced nothing")
        return guard.check(dst, length, "inbound piece destination")

    def notices_queued_for(self, peer: str) -> bool:
        """Whether a driver notice to ``peer`` waits for the I/O thread to send it."""
        # A snapshot: driver threads append to the queue meanwhile, and iterating the deque
        # itself would raise "deque mutated during iteration".
        return any(p == peer for p, _ in list(self._notices))

    # -- I/O thread ----------------------------------------------------------------------------

    def flush_notices(self) -> None:
        while self._notices:
            peer, data = self._notices.popleft()
            session = self._endpoint.sessions.get(peer)
            if session is not None and session.phase is Phase.READY:
                session.send_message("notice", data)

    def receiving(self, session: Session, delta: int) -> None:
        """A receive transfer of ``session`` started (+1) or ended (-1). A driver that must be
        driven while bytes arrive gets ``progress()`` calls from its runner, with back-off,
        from the first live receive transfer to the last; none when nothing is arriving."""
        # Any of the session's lanes may carry the transfer: each is driven while it lasts.
        for lane in session.lanes.values():
            name, driver, runner = lane.name, lane.driver, lane.runner
            count = self.receiving_now.get(name, 0) + delta
            self.receiving_now[name] = count
            if count == 1 and delta > 0 and type(driver).progress_while_receiving:
                runner.call(functools.partial(self._drive, name, driver, runner))

    def _drive(self, name: str, driver: KVTransport, runner: DriverRunner) -> None:
        """Driver thread: ``driver.progress()`` with back-off while ``name`` receives."""

        def progress() -> bool:
            if self.receiving_now.get(name, 0) <= 0:
                return True  # nothing arriving any more: the watch ends
            driver.progress()
            return False

        # Not spun: spinning here would take a core from the sender's own threads on a small host.
        runner.watch(("progress",), progress, lambda _, error: None, spin=False)


def inbound_pieces(p: Any) -> Pieces:
    """A driver's piece addresses or lengths as the guard takes them: a list of ints as it is
    (each must be a uint64 value: a negative length would pass a check that adds it), anything
    else as a uint64 array."""
    if isinstance(p, list) and p and only_ints(p):
        if min(p) < 0 or max(p) >= 1 << 64:
            raise InvalidPages("inbound piece addresses and lengths must be uint64 values")
        return p
    return np.asarray(p, dtype=np.uint64)


def _unavailable(entry: DriverHello, reason: str) -> DriverHello:
    return DriverHello(
        entry.name, entry.distribution, entry.api_version, entry.capabilities, DriverStatus(False, reason)
    )


def _close_quietly(name: str, driver: KVTransport) -> None:
    try:
        driver.close()
    except Exception:
        log.exception("driver %s failed to close", name)
