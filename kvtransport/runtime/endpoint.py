"""The user API: :class:`Endpoint`, which owns the drivers and the sessions with peers.

One endpoint per serving-engine rank: it registers the KV regions with every usable driver
once, listens on a control address, and connects to peers. A connection's ``decision`` says
which driver moves its bytes and why. A transfer is one request's pages under a tag: the
receiver announces destination pages (:meth:`Connection.expect`), the sender writes source
pages (:meth:`Transfer.send`, in chunks, the last one marked), and both poll a
:class:`State` that maps one-to-one onto SGLang's ``KVPoll``.

Who owns what (docs/architecture.md has the picture):

- the endpoint: drivers and their runners, the control channel, the session tables, limits;
- a :class:`~kvtransport.runtime.session.Session` per peer: its transfers, announcements, liveness;
- :mod:`~kvtransport.negotiation.handshake`: parsing and deciding, pure;
- threads: callers validate and plan; the I/O thread (``control``) runs sockets, timers and
  every state change; one runner thread per driver (``runner``) makes every driver call.

Any exception while handling one message is contained to that message's transfer or session:
the loop keeps serving every other peer.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvtransport.negotiation.calibration_cache import with_cached_models
from kvtransport.negotiation.handshake import (
    check_agreement,
    decide,
    label_of,
    read_peer,
    regions_from_dict,
    regions_to_dict,
)
from kvtransport.negotiation.hello import DriverHello, Hello, build_hello, describe_driver, load_drivers
from kvtransport.negotiation.negotiate import Decision
from kvtransport.negotiation.registry import Policy
from kvtransport.runtime.admission import Acceptor, Admitted, InitiatorExchange, PendingAuth
from kvtransport.runtime.auth import (
    MAX_UNSEALED_BYTES,
    RateLimitedLog,
    Secret,
    control_plane_policy,
    is_sealed,
    load_secret,
)
from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.config import Limits, Timeouts, express_from_env
from kvtransport.runtime.control import ControlChannel, Route, address_host, advertised_host
from kvtransport.runtime.environment import warn_unknown_env_vars
from kvtransport.runtime.express import ExpressPort
from kvtransport.runtime.handles import Connection, State, Transfer
from kvtransport.runtime.lane import Lane
from kvtransport.runtime.metrics import Metrics
from kvtransport.runtime.runner import DriverRunner
from kvtransport.runtime.session import Phase, Session
from kvtransport.runtime.tags import TagBook
from kvtransport.runtime.wire import Message, decode, encode, max_message_bytes
from kvtransport.spi.driver import DriverStatus, KVTransport
from kvtransport.spi.errors import (
    AuthenticationFailed,
    ChannelDown,
    ConnectError,
    DriverError,
    EndpointDown,
    InvalidPages,
    KVTransportError,
    MemoryLayoutError,
    NegotiationError,
    PeerLost,
    ProtocolError,
    TransferAborted,
)
from kvtransport.spi.inbound import Pieces
from kvtransport.spi.memory import KVLayout, RegionSet
from kvtransport.spi.plan import only_ints
from kvtransport.spi.probe import probe_host

log = logging.getLogger(__name__)

#: Protocol violations a session may commit before it is closed.
MAX_STRIKES = 16
#: Messages kept for an initiator between the welcome and its own driver connect.
MAX_HELD = 4096
#: Routes remembered after their session ended, for a heartbeat timeout, so that what their peer
#: sent before it learnt of the end (the copy of a "bye" sent on both channels, a heartbeat that
#: crossed it) is dropped quietly rather than warned about as a stranger's. Bounded: the oldest
#: goes first.
MAX_ENDED_ROUTES = 1024
#: What a peer that failed authentication is told, and nothing more.
AUTH_FAILED = "authentication failed"

_insecure_warned = False

__all__ = [
    "Connection",
    "Endpoint",
    "Limits",
    "State",
    "Timeouts",
    "Transfer",
    "regions_from_dict",
    "regions_to_dict",
]


class _Context:
    """What a driver instance gets from its endpoint (see ``DriverContext``)."""

    def __init__(self, endpoint: Endpoint, name: str, options: Mapping[str, str]) -> None:
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


class Endpoint:
    """A rank's KV regions, registered once, reachable at a control address."""

    def __init__(
        self,
        regions: RegionSet,
        layout: KVLayout,
        *,
        listen: str = "tcp://127.0.0.1:0",
        drivers: Mapping[str, type[KVTransport]] | None = None,
        policy: Policy | None = None,
        name: str | None = None,
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        driver_options: Mapping[str, str] | None = None,
        max_run_bytes: int | None = None,
        secret: bytes | str | Secret | None = None,
        express: bool | None = None,
    ) -> None:
        if layout.kv_item_lens != regions.kv_item_lens:
            raise MemoryLayoutError(
                f"layout says KV pages of {layout.kv_item_lens[:4]}... bytes, the regions hold "
                f"{regions.kv_item_lens[:4]}...; they must match region by region"
            )
        if layout.memory != regions.kv_kind:
            raise MemoryLayoutError(f"layout says KV in {layout.memory}, regions are in {regions.kv_kind}")
        if layout.state_item_lens not in ((), regions.state_item_lens):
            raise MemoryLayoutError(
                f"layout says state items of {[list(g) for g in layout.state_item_lens][:4]} bytes per group, the "
                f"regions hold {[list(g) for g in regions.state_item_lens][:4]}; they must match group by group"
            )
        if layout.state_types and len(layout.state_types) != len(regions.state_groups):
            raise MemoryLayoutError(
                f"layout names {len(layout.state_types)} state groups, the regions have {len(regions.state_groups)}"
            )
        self.regions = regions
        self.layout = layout
        self.name = name or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        # Before any driver registers memory: an endpoint that may not listen never starts.
        self.secret = secret if isinstance(secret, Secret) else load_secret(secret)
        #: One line: whether the control plane is authenticated, and why (``doctor`` shows it).
        self.security = control_plane_policy(listen, self.secret)
        if not self.secret.authenticated and self.security.startswith("NOT"):
            global _insecure_warned
            if not _insecure_warned:
                _insecure_warned = True
                log.warning("kvtransport control plane %s", self.security)
        self._auth_log = RateLimitedLog(log)
        self.timeouts = timeouts or Timeouts.from_env()
        self.limits = limits or Limits.from_env()
        #: The acceptor's side of the authentication exchange (admission.py: no I/O there).
        self._admission = Acceptor(self.secret, self.limits.max_pending_handshakes, self.timeouts.connect)
        use_express = express_from_env() if express is None else express
        if max_run_bytes is not None and max_run_bytes <= 0:
            raise ValueError(f"max_run_bytes must be positive, got {max_run_bytes}")
        self.max_run_bytes = max_run_bytes
        self.host = advertised_host(listen)
        if drivers is None:
            loaded = load_drivers()
            classes, hellos = loaded.classes, dict(loaded.hellos)
        else:
            classes = dict(drivers)
            hellos = {n: describe_driver(c) for n, c in classes.items()}
        warn_unknown_env_vars(driver_vars=[v for c in classes.values() for v in c.env_vars])
        self.policy = policy if policy is not None else Policy.from_env(known=hellos)
        self.classes = classes
        self.drivers: dict[str, KVTransport] = {}
        self.runners: dict[str, DriverRunner] = {}
        self.sessions: dict[str, Session] = {}
        #: Which session owns each tag, early announcements and aborts, refused tags (I/O thread).
        self.tags: TagBook[Session] = TagBook(self.name, self.limits)
        self._by_route: dict[Route, Session] = {}
        #: Route -> until when its frames are dropped quietly (see ``MAX_ENDED_ROUTES``).
        self._ended_routes: collections.OrderedDict[Route, float] = collections.OrderedDict()
        self._incoming: collections.deque[Session] = collections.deque()
        self._incoming_cv = threading.Condition()
        self._warned: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._notices: collections.deque[tuple[str, bytes]] = collections.deque()
        self._batch_ids = itertools.count(1)
        self._receiving: dict[str, int] = {}  # driver -> live receive transfers (I/O thread)
        self.pending_handshakes = 0
        #: Finished transfers counted per driver and peer (docs/metrics.md).
        self.metrics = Metrics(gauges=self._gauges)
        #: Largest message taken or sent (``KVTRANSPORT_MAX_MESSAGE_BYTES``, read once, before
        #: anything is acquired: a bad value fails here).
        self.max_message_bytes = max_message_bytes()
        self._closed = False
        self._down: KVTransportError | None = None
        self._hellos: dict[str, DriverHello] = {}
        try:
            self._open_drivers(hellos, driver_options or {})
            host = probe_host()
            self._hellos = with_cached_models(self._hellos, host.host_id)
            self.hello: Hello = build_hello(
                self._hellos, layout=layout, policy=self.policy, endpoint=self.name, host=host
            )
            self._regions_doc = regions_to_dict(regions)
            self.channel = ControlChannel(
                listen,
                self._on_frame,
                max_message_bytes=self.max_message_bytes,
                frames_per_pass=self.limits.frames_per_pass,
                max_queued_calls=self.limits.max_queued_calls,
                on_crash=self._on_crash,
                # A connection must carry a session as soon as a connect() would have given up.
                unclaimed_timeout=self.timeouts.connect,
                max_unclaimed=self.limits.max_unclaimed_connections,
            )
        except BaseException:
            self._close_drivers()
            raise
        #: The express streams (express.py), unless KVTRANSPORT_EXPRESS=0 or its port cannot open.
        self.express: ExpressPort[Session] | None = None
        try:
            if use_express:
                try:
                    self.express = ExpressPort(self, address_host(listen))
                    self.channel.call_soon(self.express.start)
                except (OSError, UnicodeError, KVTransportError) as exc:
                    if self.express is not None:
                        self.express.close()
                        self.express = None
                    log.warning(
                        "endpoint %s: no express streams (%s); 'done' takes the control channel", self.name, exc
                    )
            self.address = self.channel.address
            for name, driver in self.drivers.items():
                self.runners[name] = DriverRunner(name, driver, self.post)
        except BaseException:
            # Whatever was acquired goes: the loop and its streams, then runners and drivers.
            port = self.express
            self.channel.close(port.close if port is not None else None)
            if port is not None and not self.channel.running:
                port.close()
            self._close_drivers()
            raise
        log.debug(
            "endpoint %s listening on %s (express port %s)",
            self.name,
            self.address,
            self.express.port if self.express is not None else "none",
        )

    # -- set-up ----------------------------------------------------------------------------

    def _open_drivers(self, hellos: dict[str, DriverHello], options: Mapping[str, str]) -> None:
        """Register the regions with every driver that can serve them, once each (each
        driver's entry in ``_hellos``, opened or with why not)."""
        memory = self.regions.kv_kind
        for name, entry in hellos.items():
            cls = self.classes.get(name)
            allowed, _ = self.policy.permits(name)
            if cls is None or entry.status is None or not entry.status.serves(memory) or not allowed:
                self._hellos[name] = entry
                continue
            driver: KVTransport | None = None
            try:
                driver = cls(_Context(self, name, options))
                conn = driver.open(self.regions)
            except Exception as exc:
                if isinstance(exc, KVTransportError):
                    log.warning("driver %s could not open this endpoint's regions: %s", name, exc)
                    reason = f"open() failed: {exc}"
                else:
                    log.exception("driver %s crashed in open()", name)
                    reason = f"open() raised {type(exc).__name__}: {exc}"
                self._hellos[name] = _unavailable(entry, reason)
                if driver is not None:
                    _close_quietly(name, driver)
                continue
            except BaseException:  # interrupted: the caller's cleanup knows only the opened ones
                if driver is not None:
                    _close_quietly(name, driver)
                raise
            self.drivers[name] = driver
            self._hellos[name] = DriverHello(
                name, entry.distribution, entry.api_version, entry.capabilities, entry.status, "", conn
            )

    def _close_drivers(self) -> None:
        for name, runner in list(self.runners.items()):
            if not runner.stop():
                log.warning("driver %s: its thread is still inside the engine; closing it anyway", name)
        for name, driver in list(self.drivers.items()):
            _close_quietly(name, driver)

    # -- public API --------------------------------------------------------------------------

    def connect(self, address: str, timeout: float | None = None) -> Connection:
        """Handshake with the endpoint at ``address``; the connection's ``decision`` says
        which driver was chosen and why. Raises on refusal, mismatch or timeout."""
        timeout = self.timeouts.connect if timeout is None else timeout
        conn_id = uuid.uuid4().hex
        started = threading.Event()
        holder: list[Session | KVTransportError] = []
        # Whether the caller stopped waiting for ``start``: checked by ``start`` under
        # ``start_lock``, so a start that runs after the caller gave up creates nothing (it
        # once left a session and a socket nobody held, connected on both sides).
        start_lock = threading.Lock()
        gave_up: list[bool] = []

        def start() -> None:
            with start_lock:
                if gave_up:
                    return
                try:
                    if len(self.sessions) >= self.limits.max_connections:
                        raise ConnectError(
                            f"{self.name} already has {len(self.sessions)} connections (KVTRANSPORT_MAX_CONNECTIONS)"
                        )
                    try:
                        route = self.channel.connect(address, conn_id)
                    except Exception as exc:
                        raise ConnectError(f"cannot connect to {address!r}: {exc}") from exc
                    session = Session(self, conn_id, route, address, address, initiator=True)
                    self._file(session)
                    holder.append(session)
                    # Nothing about this endpoint goes out before the peer proved the secret.
                    session.exchange = InitiatorExchange(conn_id)
                    session.send("auth", **session.exchange.opening())
                except KVTransportError as exc:
                    holder.append(exc)
                finally:
                    started.set()

        def give_up() -> None:
            """Nobody will hold what ``start`` creates: it creates nothing, or it is ended."""
            with start_lock:
                gave_up.append(True)
                made = holder[0] if holder else None
            if isinstance(made, Session):
                with contextlib.suppress(KVTransportError):
                    self.call(
                        lambda: self.end_session(made, ConnectError(f"gave up connecting to {address}"), notify=True)
                    )

        try:
            self.call(start)
            started_in_time = started.wait(timeout)
        except BaseException:  # interrupted (or the endpoint went)
            give_up()
            raise
        if not started_in_time:
            with start_lock:
                if not holder:
                    gave_up.append(True)
                    raise ConnectError(f"could not start connecting to {address}: the endpoint's I/O thread is busy")
        if not holder:  # ``start`` failed with something other than a kvtransport error (logged)
            raise ConnectError(f"could not start connecting to {address}")
        if isinstance(holder[0], KVTransportError):
            raise holder[0]
        session = holder[0]
        try:
            answered = session.ready.wait(max(0.0, timeout))
        except BaseException:  # interrupted: nobody will hold this session
            give_up()
            raise
        if not answered:
            self.call(lambda: self.end_session(session, ConnectError(f"gave up connecting to {address}"), notify=False))
            raise ConnectError(f"no handshake answer from {address} within {timeout} s (is an endpoint listening?)")
        if session.phase is not Phase.READY:
            raise session.error or ConnectError(f"connection to {address} failed")
        return session.handle

    def accept(self, timeout: float | None = None) -> Connection:
        """The next connection a peer opened to this endpoint."""
        with self._incoming_cv:
            # Also woken when the endpoint closes or its I/O thread stops: no connection can
            # come then, and a wait without a timeout would last for ever.
            if not self._incoming_cv.wait_for(
                lambda: bool(self._incoming) or self._closed or self._down is not None, timeout
            ):
                raise ConnectError(f"no peer connected within {timeout} s")
            if not self._incoming:
                self.check_running()
            return self._incoming.popleft().handle

    def announced(self, tag: str) -> Connection | None:
        """The live connection whose receiver announced pages for ``tag`` (a sender that
        serves many receivers learns here which one a request belongs to), or ``None`` yet."""
        session = self.tags.owner(tag)
        if session is not None and session.phase is Phase.READY:
            return session.handle
        return None

    def refuse(self, tag: str, reason: str) -> None:
        """Sender side: nothing will ever be sent for ``tag``. A receiver that announced it hears
        so now; one whose announcement is still on its way hears so the moment it arrives (a
        serving engine may give up on a request before the other side has asked for it).
        Returns at once; remembered for the last ``max_early_aborts`` tags refused."""

        def run() -> None:
            owner = self.tags.refuse(tag, reason)
            if owner is not None:  # its peer's announcement was waiting for a sender
                owner.send("abort", tag=tag, reason=reason)
                owner.send_drained(tag)  # nothing of it was ever written

        self.call(run)

    @property
    def connections(self) -> dict[str, Connection]:
        """A snapshot of the live connections, by id."""
        return {k: s.handle for k, s in list(self.sessions.items())}

    def stats(self) -> dict[str, int]:
        """What the endpoint holds now (tests compare it with a baseline; nothing here grows
        with the number of peers served in the past)."""
        sessions = list(self.sessions.values())
        return {
            "sessions": len(sessions),
            "routes": len(self._by_route),
            "incoming": len(self._incoming),
            "pending_handshakes": self.pending_handshakes,
            "pending_auth": len(self._admission.pending),
            "transfers": sum(len(s.transfers) for s in sessions),
            **self.tags.stats(),  # early_expects, early_expect_bytes, early_aborts, refused, tag_owners
            "awaiting_drain": sum(len(s.awaiting_drain) for s in sessions),
            "timers": len(self.channel.timers),
            "dealers": self.channel.dealer_count,
            "unclaimed": len(self.channel.unclaimed),
            "express_links": self.express.links if self.express is not None else 0,
            "express_unbound": self.express.unbound if self.express is not None else 0,
            "warned": len(self._warned),
            "watches": sum(r.watching for r in self.runners.values()),
            "handles": sum(_pending_handles(d) for d in self.drivers.values()),
        }

    def _gauges(self) -> dict[str, Any]:
        """What the endpoint and its drivers hold now (read at each metrics snapshot)."""
        sessions = list(self.sessions.values())
        out: dict[str, Any] = {
            "connections": len(sessions),
            "transfers": sum(1 for s in sessions for t in list(s.transfers.values()) if not t.state.final),
            "drivers": {},
        }
        for name, driver in list(self.drivers.items()):
            try:
                out["drivers"][name] = {k: float(v) for k, v in driver.gauges().items()}
            except Exception as exc:  # noqa: BLE001 - a driver's bug must not break a snapshot
                log.debug("driver %s: gauges() raised %s", name, exc)
        return out

    def close(self) -> None:
        """Tell peers, fail what is in flight, release every driver. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self._wake_acceptors()

        def final() -> None:
            for session in list(self.sessions.values()):
                if session.phase is Phase.READY:
                    session.send("bye", reason="endpoint closed")
                self.end_session(session, TransferAborted(f"endpoint {self.name} closed"), notify=False)
            if self.express is not None:
                self.express.close()

        try:
            self.channel.close(final)
        except Exception:
            log.exception("closing the control channel failed")
        if self.express is not None and not self.channel.running:
            self.express.close()  # the loop stopped before it ran ``final`` (or died)
        self._close_drivers()

    def _wake_acceptors(self) -> None:
        """Callers waiting in :meth:`accept` look again (the endpoint closed or went down)."""
        with self._incoming_cv:
            self._incoming_cv.notify_all()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- any thread --------------------------------------------------------------------------

    def check_running(self) -> None:
        """Raise what :meth:`call` would raise now: the endpoint is closed or its I/O thread is down."""
        if self._closed:
            raise KVTransportError(f"endpoint {self.name} is closed")
        if self._down is not None:
            raise self._down

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread (soon)."""
        self.check_running()
        try:
            self.channel.call_soon(fn)
        except ChannelDown as exc:
            raise self._down or EndpointDown(f"endpoint {self.name}: {exc}") from exc

    def post(self, fn: Callable[[], None]) -> None:
        """From a runner thread: a driver call's result, to the I/O thread."""
        self.channel.call_soon(fn)

    def queue_notice(self, peer: str, payload: bytes, driver: str = "") -> None:
        # Queued in order; the I/O thread flushes the queue before it sends any "done", so a
        # notice a driver sent before reporting a batch complete always reaches the peer before
        # the "done" that follows that batch.
        # In ordered mode (session.py) it goes out right here, on the express stream, which
        # carries that "done" too, behind it.
        session = self.sessions.get(peer)
        lane = session.wire_name(driver) if session is not None else ""
        if session is not None and session.hold_notice(lane, payload):
            return  # the thread that submitted its batch sends it, in that transfer's "done"
        data = encode("notice", self.max_message_bytes, payload=payload, lane=lane)
        if session is not None:
            with session.order_lock:
                ordered = session.ordered is not None
                if not ordered:
                    self._notices.append((peer, data))
            if ordered:
                session.send_ordered(data)
                return
        else:
            self._notices.append((peer, data))
        if self.channel.in_io_thread():
            self.flush_notices()
        else:
            self.channel.call_soon(self.flush_notices)

    def check_inbound(self, peer: str, dst: Any, length: Any) -> bool:
        """Driver thread: ``True`` when every piece lands in pages announced to ``peer``;
        ``False`` for late data of a transfer of ``peer`` that failed (drop it); raises
        :class:`InvalidPages` otherwise. Lists of ints are checked as they are (a small
        chunk's), anything else as uint64 arrays."""
        dst, length = _pieces(dst), _pieces(length)
        session = self.sessions.get(peer)
        if session is None or session.phase is not Phase.READY:
            raise InvalidPages(f"inbound data from {peer!r}, which is not connected")
        guard = session.guard
        if guard is None:
            raise InvalidPages(f"inbound data from {session.peer_label}, which was announced nothing")
        return guard.check(dst, length, "inbound piece destination")

    # -- I/O thread ----------------------------------------------------------------------------

    def receiving(self, session: Session, delta: int) -> None:
        """A receive transfer of ``session`` started (+1) or ended (-1). A driver that must be
        driven while bytes arrive gets ``progress()`` calls from its runner, with back-off,
        from the first live receive transfer to the last; none when nothing is arriving."""
        # Any of the session's lanes may carry the transfer: each is driven while it lasts.
        for lane in session.lanes.values():
            name, driver, runner = lane.name, lane.driver, lane.runner
            count = self._receiving.get(name, 0) + delta
            self._receiving[name] = count
            if count == 1 and delta > 0 and type(driver).progress_while_receiving:
                runner.call(functools.partial(self._drive, name, driver, runner))

    def _drive(self, name: str, driver: KVTransport, runner: DriverRunner) -> None:
        """Driver thread: ``driver.progress()`` with back-off while ``name`` receives."""

        def progress() -> bool:
            if self._receiving.get(name, 0) <= 0:
                return True  # nothing arriving any more: the watch ends
            driver.progress()
            return False

        # Not spun: spinning here would take a core from the sender's own threads on a small host.
        runner.watch(("progress",), progress, lambda _, error: None, spin=False)

    def next_batch_id(self) -> int:
        """Any thread (``next`` on an ``itertools.count`` is atomic)."""
        return next(self._batch_ids)

    def flush_notices(self) -> None:
        while self._notices:
            peer, data = self._notices.popleft()
            session = self.sessions.get(peer)
            if session is not None and session.phase is Phase.READY:
                session.send_message("notice", data)

    def notices_queued_for(self, peer: str) -> bool:
        """Whether a driver notice to ``peer`` waits for the I/O thread to send it."""
        # A snapshot: driver threads append to the queue meanwhile, and iterating the deque
        # itself would raise "deque mutated during iteration".
        return any(p == peer for p, _ in list(self._notices))

    def _file(self, session: Session) -> None:
        self.sessions[session.id] = session
        self._by_route[session.route] = session

    def end_session(self, session: Session, error: KVTransportError, *, notify: bool) -> None:
        """Close ``session`` and forget it with everything it held."""
        session.close(error, notify=notify)
        if self.express is not None:
            self.express.detach(session, "its session ended")
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
        if self._by_route.get(session.route) is session:
            del self._by_route[session.route]
            self._remember_ended(session.route)
        self.channel.disconnect(session.route)
        with self._incoming_cv:
            if session in self._incoming:
                self._incoming.remove(session)

    def _remember_ended(self, route: Route) -> None:
        now = time.monotonic()
        put_newest(self._ended_routes, route, now + self.timeouts.heartbeat_timeout, MAX_ENDED_ROUTES)
        while next(iter(self._ended_routes.values())) < now:  # expired (the newest is not)
            self._ended_routes.popitem(last=False)

    def _ended_lately(self, route: Route) -> bool:
        until = self._ended_routes.get(route)
        if until is None:
            return False
        if until < time.monotonic():
            del self._ended_routes[route]
            return False
        return True

    def _on_crash(self, exc: BaseException) -> None:
        """The I/O thread is dying: fail everything so no caller waits for a timeout."""
        self._down = EndpointDown(f"endpoint {self.name}: its I/O thread stopped ({type(exc).__name__}: {exc})")
        self._wake_acceptors()
        for session in list(self.sessions.values()):
            try:
                self.end_session(session, self._down, notify=False)
            except Exception:
                log.exception("failing a session after the I/O thread stopped")

    def _on_frame(self, route: Route, frame: bytes) -> None:
        session = self._by_route.get(route)
        if is_sealed(frame):
            self._on_sealed(route, session, frame)
            return
        # Unsealed: only the authentication exchange (and a refusal) travels in the clear.
        if len(frame) > MAX_UNSEALED_BYTES:
            self._stranger(route, f"dropped an unsealed frame of {len(frame)} bytes from {self._describe(route)}")
            return
        try:
            msg = decode(frame, limit=self.max_message_bytes)
        except ProtocolError as exc:
            self._stranger(route, f"bad unauthenticated control message from {self._describe(route)}: {exc}")
            return
        if session is not None and session.seal is not None:
            # Whoever sent this does not hold the session's keys: not the peer.
            self._stranger(route, f"dropped an unsealed {msg.type} message on authenticated {session.peer_label}")
            return
        try:
            if msg.type == "auth":
                self._on_auth(route, session, msg)
            elif msg.type == "challenge" and session is not None and session.initiator:
                self._on_challenge(session, msg)
            elif msg.type == "proof" and session is not None and session.initiator:
                self._on_acceptor_proof(session, msg)
            elif msg.type == "proof" and session is None:
                self._on_initiator_proof(route, msg)
            elif msg.type == "hello" and session is None:
                # A peer that skipped authentication (no secret, an older kvtransport): told no more.
                self._stranger(route, f"hello from {self._describe(route)} without authentication")
                self.channel.send(route, encode("refuse", self.max_message_bytes, conn=msg["conn"], reason=AUTH_FAILED))
            elif msg.type == "refuse" and session is not None and session.initiator:
                reason = msg["reason"]
                error: KVTransportError = (
                    AuthenticationFailed(
                        f"{session.peer_address} refused the connection: authentication failed (this side's "
                        f"secret: {self.secret.source}; every process of a deployment needs the same secret)"
                    )
                    if reason == AUTH_FAILED
                    else NegotiationError(f"{session.peer_address} refused the connection: {reason}")
                )
                self.end_session(session, error, notify=False)
            else:
                self._stranger(route, f"unauthenticated {msg.type} message from {self._describe(route)}")
        except KVTransportError as exc:
            self._stranger(route, f"invalid {msg.type} message from {self._describe(route)}: {exc}")

    def _on_sealed(self, route: Route, session: Session | None, frame: bytes) -> None:
        pending = None
        if session is not None:
            seal = session.seal
        else:
            pending = self._admission.pending.get(route)
            seal = pending.seal if pending is not None else None
        if seal is None:
            if self._ended_lately(route):
                log.debug("dropped a sealed frame from %s, whose session just ended", self._describe(route))
                return
            self._stranger(route, f"sealed message from {self._describe(route)}, which has not authenticated")
            return
        body = seal.open(frame)
        if body is None:
            self._stranger(
                route,
                f"dropped a control message for {self._describe(route)} that failed authentication "
                "(forged, replayed or corrupted)",
            )
            return
        if session is not None:
            session.last_seen = time.monotonic()
        try:
            msg = decode(body, limit=self.max_message_bytes)
        except ProtocolError as exc:
            self._violation(route, session, f"bad control message from {self._describe(route)}: {exc}")
            return
        if pending is not None:
            if msg.type != "hello":
                self._warn_once(route, f"{msg.type} message from {self._describe(route)} before its hello")
                return
            try:
                self._on_hello(route, pending, msg)
            except Exception:
                log.exception("kvtransport: handling a hello from %s failed", self._describe(route))
            return
        assert session is not None
        self.on_message(route, session, msg)

    def on_message(self, route: Route, session: Session, msg: Message) -> None:
        """An authenticated message of ``session``."""
        if session.held is not None and msg.type not in ("welcome", "refuse", "ping"):
            # Initiator between welcome and its driver's connect: the acceptor is ready and may
            # already talk; keep what it says for when this side is ready too.
            if len(session.held) < MAX_HELD:
                session.held.append(msg)
            else:
                self._violation(
                    route, session, f"{self._describe(route)} sent {MAX_HELD} messages during the handshake"
                )
            return
        try:
            if msg.type == "hello":
                session.send("refuse", conn=msg["conn"], reason="this socket already carries a connection")
            else:
                self._dispatch(session, msg)
        except KVTransportError as exc:
            self._violation(route, session, f"invalid {msg.type} message from {self._describe(route)}: {exc}", msg)
        except Exception as exc:
            # A bug of ours (or a driver's) on this message: this session can no longer be
            # trusted to be in a consistent state, every other one can.
            log.exception("kvtransport: handling a %s message from %s failed", msg.type, self._describe(route))
            self.end_session(
                session, ProtocolError(f"internal error on a {msg.type} message: {type(exc).__name__}"), notify=True
            )

    # -- authentication (docs/security.md; the primitives are in auth.py) ---------------------

    def _on_auth(self, route: Route, session: Session | None, msg: Message) -> None:
        """Acceptor: a peer opens an exchange; it gets a challenge and this side keeps nothing."""
        challenge = self._admission.on_auth(route, msg, carries_session=session is not None)
        self.channel.send(route, encode("challenge", self.max_message_bytes, **challenge))

    def _on_challenge(self, session: Session, msg: Message) -> None:
        """Initiator: prove the secret, bound to both nonces and the connection id."""
        if session.exchange is None:
            raise ProtocolError("unexpected challenge")
        session.send("proof", **session.exchange.on_challenge(self.secret, msg))

    def _on_initiator_proof(self, route: Route, msg: Message) -> None:
        """Acceptor: the initiator proved the secret (or not); prove it back. Only a verified
        initiator is remembered (until its hello, or the connect timeout)."""
        outcome = self._admission.on_proof(route, msg)
        if not isinstance(outcome, Admitted):
            self._auth_log.warning(
                "refused a connection from %s: authentication failed (its proof does not verify under this "
                "endpoint's secret, %s: the peer has another KVTRANSPORT_SECRET, or none)",
                self._describe(route),
                self.secret.source,
            )
            self.channel.send(route, encode("refuse", self.max_message_bytes, conn=msg["conn"], reason=AUTH_FAILED))
            return
        timers = self.channel.timers
        for old in outcome.evicted:
            timers.cancel(old.timer)
        outcome.entry.timer = timers.call_later(
            self.timeouts.connect, functools.partial(self._admission.expire, route, outcome.entry)
        )
        self.channel.send(route, encode("proof", self.max_message_bytes, **outcome.answer))

    def _on_acceptor_proof(self, session: Session, msg: Message) -> None:
        """Initiator: the acceptor proved the secret; only now does this side say who it is."""
        if session.exchange is None:
            raise ProtocolError("unexpected proof")
        outcome = session.exchange.on_proof(self.secret, msg)
        if not isinstance(outcome, tuple):
            self._auth_log.warning(
                "%s did not prove it holds this deployment's secret (%s)", session.peer_address, self.secret.source
            )
            self.end_session(
                session,
                AuthenticationFailed(
                    f"authentication failed: {session.peer_address} did not prove it holds this deployment's "
                    f"secret (this side's: {self.secret.source}); is it a kvtransport endpoint of this deployment?"
                ),
                notify=False,
            )
            return
        session.seal, session.express_seal = outcome
        session.send("hello", conn=session.id, hello=self.hello.to_dict(), regions=self._regions_doc)

    def _stranger(self, route: Route, text: str) -> None:
        """Something from a party that has not authenticated: dropped, logged rate-limited,
        no strike (it could not have come from the session's peer)."""
        self._auth_log.warning("%s", text)

    def _violation(self, route: Route, session: Session | None, text: str, msg: Message | None = None) -> None:
        """A peer broke the protocol: fail the transfer it named, count a strike on its session."""
        self._warn_once(route, text)
        if session is None or session.phase is Phase.CLOSED:
            return
        tag = msg.fields.get("tag") if msg is not None else None
        t = session.transfers.get(tag) if isinstance(tag, str) else None
        if t is not None and not t.state.final:
            session.abort(t, text, notify=True, error=ProtocolError(text))
        session.strikes += 1
        if session.strikes >= MAX_STRIKES:
            session.send("bye", reason=f"{MAX_STRIKES} protocol violations")
            self.end_session(
                session, ProtocolError(f"{session.peer_label}: {MAX_STRIKES} protocol violations"), notify=False
            )

    def _dispatch(self, session: Session, msg: Message) -> None:
        kind = msg.type
        if session.phase is Phase.HANDSHAKE:
            if kind == "welcome" and session.initiator:
                self._on_welcome(session, msg)
            elif kind == "refuse" and session.initiator:
                self.end_session(
                    session,
                    NegotiationError(f"{session.peer_address} refused the connection: {msg['reason']}"),
                    notify=False,
                )
            elif kind != "ping":
                raise ProtocolError(f"{kind} before the handshake finished")
            return
        if kind == "expect":
            session.on_expect(msg)
        elif kind == "done":
            session.on_done(msg)
        elif kind == "abort":
            session.on_abort(msg)
        elif kind == "drained":
            session.on_drained(msg)
        elif kind == "notice":
            session.on_notice(msg)
        elif kind == "bye":
            self.end_session(
                session, PeerLost(f"peer {session.peer_label} closed its endpoint ({msg['reason']})"), notify=False
            )
        elif kind in ("hello", "welcome", "refuse", "auth", "challenge", "proof"):
            raise ProtocolError(f"{kind} on a connection that is already open")
        # "ping" needs nothing beyond last_seen

    # -- handshake ---------------------------------------------------------------------------

    def _on_hello(self, route: Route, auth: PendingAuth, msg: Message) -> None:
        conn_id = msg["conn"]
        seal = auth.seal
        assert seal is not None

        def refuse(reason: str) -> None:
            log.warning("refusing connection from %s: %s", self._describe(route), reason)
            self.channel.send(route, seal.seal(encode("refuse", self.max_message_bytes, conn=conn_id, reason=reason)))

        if conn_id != auth.conn:
            refuse("the hello's connection id is not the one authenticated")
            return
        if conn_id in self.sessions:
            refuse(f"connection id {conn_id[:16]!r} is in use")
            return
        if len(self.sessions) >= self.limits.max_connections:
            refuse(f"{self.name} has {len(self.sessions)} connections, its limit (KVTRANSPORT_MAX_CONNECTIONS)")
            return
        if self.pending_handshakes >= self.limits.max_pending_handshakes:
            refuse(f"{self.name} is busy with {self.pending_handshakes} handshakes; try again")
            return
        try:
            peer_hello, peer_regions = read_peer(msg["hello"], msg["regions"])
            decision = decide(peer_hello, self.hello, self.classes)
            lanes = self._lanes(decision, peer_hello)
        except KVTransportError as exc:
            refuse(f"{type(exc).__name__}: {exc}")
            return
        session = Session(self, conn_id, route, label_of(peer_hello), "", initiator=False)
        session.seal = seal
        session.express_seal = auth.express_seal
        session.peer_hello = peer_hello
        self._admission.take(route)
        self.channel.timers.cancel(auth.timer)
        session.decision, session.peer_regions, session.lanes = decision, peer_regions, lanes
        self._file(session)
        self.channel.claim(route)
        self.pending_handshakes += 1

        def connected(_: Any, error: KVTransportError | None) -> None:
            self.pending_handshakes -= 1
            if session.phase is Phase.CLOSED:
                return
            if error is not None:
                refuse(f"{type(error).__name__}: {error}")
                self.end_session(session, error, notify=False)
                return
            session.send(
                "welcome",
                conn=conn_id,
                hello=self.hello.to_dict(),
                regions=self._regions_doc,
                decision=decision.to_dict(),
                express=self.express.port if self.express is not None else 0,
            )
            self._ready(session)
            log.info("accepted %s from %s: %s", conn_id[:8], session.peer_label, decision.summary())
            with self._incoming_cv:
                self._incoming.append(session)
                self._incoming_cv.notify_all()

        self._connect_lanes(session, peer_regions, connected)

    def _on_welcome(self, session: Session, msg: Message) -> None:
        if session.decision is not None:
            raise ProtocolError("a second welcome")
        try:
            peer_hello, peer_regions = read_peer(msg["hello"], msg["regions"])
            session.peer_label = label_of(peer_hello)
            session.peer_hello = peer_hello
            decision = decide(self.hello, peer_hello, self.classes)
            check_agreement(msg["decision"], decision, session.peer_label)
            lanes = self._lanes(decision, peer_hello)
        except KVTransportError as exc:
            session.send("bye", reason=f"handshake failed: {exc}")
            self.end_session(session, exc, notify=False)
            return
        session.decision, session.peer_regions, session.lanes = decision, peer_regions, lanes
        session.held = []
        if self.express is not None and msg["express"]:
            self.express.dial(session, msg["express"])

        def connected(_: Any, error: KVTransportError | None) -> None:
            held, session.held = session.held or [], None
            if session.phase is Phase.CLOSED:
                return
            if error is not None:
                session.send("bye", reason=f"handshake failed: {error}")
                self.end_session(session, error, notify=False)
                return
            self._ready(session)
            log.info("connected %s to %s: %s", session.id[:8], session.peer_label, decision.summary())
            for early in held:
                if session.closed:
                    break  # one of them ended it: the rest must not claim tags for a dead session
                try:
                    self._dispatch(session, early)
                except KVTransportError as exc:
                    self._violation(session.route, session, f"invalid {early.type} message: {exc}", early)

        self._connect_lanes(session, peer_regions, connected)

    def _lanes(self, decision: Decision, peer_hello: Hello) -> dict[str, Lane]:
        """A lane per driver of the decision (the chosen one first): the open driver, its
        runner, and the peer's (checked) connection info for it."""
        lanes: dict[str, Lane] = {}
        for name in decision.lanes or (decision.driver,):
            driver = self.drivers.get(name)
            entry = peer_hello.drivers.get(name)
            if driver is None or entry is None:
                raise NegotiationError(f"{name} was chosen but is not open on both sides")
            self._check_identity(name, entry.conn)
            lanes[name] = Lane(name, driver, self.runners[name], entry.conn, decision.models_of(name))
        return lanes

    def _check_identity(self, driver: str, peer_info: Any) -> None:
        """A peer's engine identity (its driver connection info) is its own: not this
        endpoint's (a mirror would make this side write into its own pool) and not that of a
        live connection (a replayed hello would direct writes into someone else's memory)."""
        if not isinstance(peer_info, bytes):
            raise ProtocolError("the peer's driver connection info is not bytes")
        if peer_info and peer_info == self._hellos[driver].conn:
            raise NegotiationError(f"the peer presented this endpoint's own {driver} connection info")
        for other in self.sessions.values():
            lane = other.lanes.get(driver)
            if peer_info and lane is not None and lane.peer_info == peer_info:
                raise NegotiationError(f"another live connection ({other.peer_label}) has this {driver} identity")

    def _connect_lanes(
        self,
        session: Session,
        peer_regions: RegionSet,
        then: Callable[[Any, KVTransportError | None], None],
    ) -> None:
        """``driver.connect`` of every lane on its driver's thread (it may block on the
        engine), all bounded by the connect timeout; ``then`` runs on the I/O thread once every
        lane answered (with the first error), or when the timeout passes."""
        conn_id, lanes = session.id, list(session.lanes.values())
        answered = [False]
        left = [len(lanes)]
        first: list[KVTransportError] = []

        def finish(error: KVTransportError | None) -> None:
            if not answered[0]:
                answered[0] = True
                self.channel.timers.cancel(session.handshake_timer)
                then(None, error)

        def one(_: Any, error: KVTransportError | None) -> None:
            if error is not None:
                first.append(error)
            left[0] -= 1
            if left[0] == 0 or error is not None:
                finish(first[0] if first else None)

        names = ", ".join(lane.name for lane in lanes)
        session.handshake_timer = self.channel.timers.call_later(
            self.timeouts.connect,
            lambda: finish(DriverError(f"connect() of {names} took longer than {self.timeouts.connect} s")),
        )
        for lane in lanes:
            # From here the driver may know the peer: closing the session disconnects it (queued
            # behind this connect, so it runs after it whatever the order of events).
            lane.connect_queued = True
            driver, info = lane.driver, lane.peer_info
            lane.runner.call(functools.partial(driver.connect, conn_id, info, peer_regions), one)

    def _ready(self, session: Session) -> None:
        session.phase = Phase.READY
        session.last_seen = time.monotonic()
        self._schedule_heartbeat(session)
        session.ready.set()

    def _schedule_heartbeat(self, session: Session) -> None:
        def beat() -> None:
            if session.phase is not Phase.READY:
                return
            now = time.monotonic()
            silent = now - session.last_seen
            if silent > self.timeouts.heartbeat_timeout:
                self.end_session(
                    session,
                    PeerLost(
                        f"peer {session.peer_label} stopped answering: no message for {silent:.1f} s "
                        f"(heartbeat timeout {self.timeouts.heartbeat_timeout} s)"
                    ),
                    notify=False,
                )
                return
            session.send("ping", seq=int(now * 1000))
            session.heartbeat = self.channel.timers.call_later(self.timeouts.heartbeat_interval, beat)

        session.heartbeat = self.channel.timers.call_later(self.timeouts.heartbeat_interval, beat)

    # -- logging -----------------------------------------------------------------------------

    def _warn_once(self, route: Route, text: str) -> None:
        key = route[1] if route[0] == "in" else route
        if key not in self._warned:
            put_newest(self._warned, key, None, self.limits.max_warned_peers)
            log.warning("%s (further problems from this peer are logged at DEBUG)", text)
        else:
            log.debug("%s", text)

    def _describe(self, route: Route) -> str:
        session = self._by_route.get(route)
        if session is not None:
            return session.peer_label or session.peer_address
        return str(route[1]) if route[0] == "out" else f"peer {bytes(route[1]).hex()}"


def _unavailable(entry: DriverHello, reason: str) -> DriverHello:
    return DriverHello(
        entry.name, entry.distribution, entry.api_version, entry.capabilities, DriverStatus(False, reason)
    )


def _close_quietly(name: str, driver: KVTransport) -> None:
    try:
        driver.close()
    except Exception:
        log.exception("driver %s failed to close", name)


def _pending_handles(driver: KVTransport) -> int:
    try:
        return int(driver.pending())
    except Exception:  # noqa: BLE001 - diagnostics only
        return -1


def _pieces(p: Any) -> Pieces:
    """A driver's piece addresses or lengths as the guard takes them: a list of ints as it is
    (each must be a uint64 value: a negative length would pass a check that adds it), anything
    else as a uint64 array."""
    if isinstance(p, list) and p and only_ints(p):
        if min(p) < 0 or max(p) >= 1 << 64:
            raise InvalidPages("inbound piece addresses and lengths must be uint64 values")
        return p
    return np.asarray(p, dtype=np.uint64)
