"""The user API: :class:`Endpoint`, which owns the drivers and the sessions with peers.

One endpoint per serving-engine rank: it registers the KV regions with every usable driver
once, listens on a control address, and connects to peers. A connection's ``decision`` says
which driver moves its bytes and why. A transfer is one request's pages under a tag: the
receiver announces destination pages (:meth:`Connection.expect`), the sender writes source
pages (:meth:`Transfer.send`, in chunks, the last one marked), and both poll a
:class:`State` that maps one-to-one onto SGLang's ``KVPoll``.

This module owns the endpoint's life (start, close, the I/O thread's death), the public API
(connect, accept, announced, refuse, connections, stats), the I/O thread's queue and the
session tables (by id, by route, routes whose session just ended, the accept queue); it is the
``SessionHost`` of every session. Who owns the rest (docs/architecture.md has the picture):

- the endpoint's side of its drivers: opening and closing them, their context, their notices
  and inbound checks: :mod:`~kvtransport.runtime.driver_context`;
- frames in (unseal, authenticate, route to a session, violations): :mod:`~kvtransport.runtime.routing`;
- the handshake, from connect or hello to a ready session, and heartbeats:
  :mod:`~kvtransport.runtime.session_setup`;
- a :class:`~kvtransport.runtime.session.Session` per peer: its transfers, announcements, liveness;
- :mod:`~kvtransport.negotiation.handshake`: parsing and deciding, pure;
- threads: callers validate and plan; the I/O thread (``control``) runs sockets, timers and
  every state change; one runner thread per driver (``runner``) makes every driver call.

Any exception while handling one message is contained to that message's transfer or session:
the loop keeps serving every other peer.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from kvtransport.negotiation.calibration_cache import with_cached_models
from kvtransport.negotiation.handshake import regions_from_dict, regions_to_dict
from kvtransport.negotiation.hello import DriverHello, Hello, build_hello, describe_driver, load_drivers
from kvtransport.negotiation.registry import Policy
from kvtransport.runtime.admission import Acceptor
from kvtransport.runtime.auth import Secret, control_plane_policy, load_secret
from kvtransport.runtime.auth_failures import WINDOW_S, AuthFailures
from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.config import Limits, Timeouts, express_from_env
from kvtransport.runtime.control import ControlChannel, Route, address_host, advertised_host
from kvtransport.runtime.driver_context import DriverTraffic, close_drivers, open_drivers, pending_handles
from kvtransport.runtime.driver_context import inbound_pieces as _pieces  # noqa: F401 - tests/test_inbound.py calls it
from kvtransport.runtime.environment import warn_unknown_env_vars
from kvtransport.runtime.express import ExpressPort
from kvtransport.runtime.handles import Connection, State, Transfer
from kvtransport.runtime.metrics import Metrics
from kvtransport.runtime.readiness import ReadinessWatcher
from kvtransport.runtime.routing import Router
from kvtransport.runtime.runner import DriverRunner
from kvtransport.runtime.session import Phase, Session
from kvtransport.runtime.session_setup import SessionSetup
from kvtransport.runtime.tags import TagBook
from kvtransport.runtime.wire import Message, max_message_bytes
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import (
    ChannelDown,
    ConnectError,
    EndpointDown,
    KVTransportError,
    MemoryLayoutError,
    TransferAborted,
)
from kvtransport.spi.memory import KVLayout, RegionSet
from kvtransport.spi.probe import probe_host

log = logging.getLogger(__name__)

#: Routes remembered after their session ended, for a heartbeat timeout, so that what their peer
#: sent before it learnt of the end (the copy of a "bye" sent on both channels, a heartbeat that
#: crossed it) is dropped quietly rather than warned about as a stranger's. Bounded: the oldest
#: goes first.
MAX_ENDED_ROUTES = 1024

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
        self.timeouts = timeouts or Timeouts.from_env()
        self.limits = limits or Limits.from_env()
        #: The acceptor's side of the authentication exchange (admission.py: no I/O there).
        self._admission = Acceptor(self.secret, self.limits.max_pending_handshakes, self.timeouts.connect)
        #: Connections to this endpoint that failed authentication: counts, the last time and
        #: source, one warning per window (auth_failures.py); kept long enough for a request
        #: to be checked against the failures around its arrival (``Timeouts.auth_grace``).
        self.auth_failures = AuthFailures(
            self.name, self.secret.source, keep=WINDOW_S + 2 * min(self.timeouts.auth_grace, self.timeouts.bootstrap)
        )
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
        #: Driver notices for peers, inbound checks, receiving drivers driven (driver_context.py).
        self._traffic = DriverTraffic(self)
        self._batch_ids = itertools.count(1)
        self._receiving = self._traffic.receiving_now  # driver -> live receive transfers (I/O thread)
        self.pending_handshakes = 0
        #: Finished transfers counted per driver and peer (docs/metrics.md).
        self.metrics = Metrics(gauges=self._gauges, auth=self.auth_failures.snapshot)
        #: Largest message taken or sent (``KVTRANSPORT_MAX_MESSAGE_BYTES``, read once, before
        #: anything is acquired: a bad value fails here).
        self.max_message_bytes = max_message_bytes()
        self._closed = False
        self._down: KVTransportError | None = None
        #: Waits for layer-wise senders' readiness signals (``runtime.readiness``), made on first use.
        self._readiness: ReadinessWatcher | None = None
        self._readiness_lock = threading.Lock()
        self._hellos: dict[str, DriverHello] = {}
        try:
            self._hellos = open_drivers(self, hellos, driver_options or {}, self.drivers)
            host = probe_host()
            self._hellos = with_cached_models(self._hellos, host.host_id)
            self.hello: Hello = build_hello(
                self._hellos, layout=layout, policy=self.policy, endpoint=self.name, host=host
            )
            #: The handshake (session_setup.py), and every frame and message in (routing.py).
            self._setup = SessionSetup(self, self._admission, self._hellos, regions)
            self._router = Router(self, self._setup, self._admission, self._by_route, self._ended_lately)
            self.channel = ControlChannel(
                listen,
                self._router.on_frame,
                max_message_bytes=self.max_message_bytes,
                frames_per_pass=self.limits.frames_per_pass,
                max_queued_calls=self.limits.max_queued_calls,
                on_crash=self._on_crash,
                # A connection must carry a session as soon as a connect() would have given up.
                unclaimed_timeout=self.timeouts.connect,
                max_unclaimed=self.limits.max_unclaimed_connections,
            )
        except BaseException:
            close_drivers(self.runners, self.drivers)
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
            close_drivers(self.runners, self.drivers)
            raise
        log.debug(
            "endpoint %s listening on %s (express port %s)",
            self.name,
            self.address,
            self.express.port if self.express is not None else "none",
        )

    # -- public API --------------------------------------------------------------------------

    def connect(self, address: str, timeout: float | None = None) -> Connection:
        """Handshake with the endpoint at ``address``; the connection's ``decision`` says
        which driver was chosen and why. Raises on refusal, mismatch or timeout."""
        return self._setup.connect(address, timeout)

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
            # Connections that failed authentication in the last minute (a bounded record of
            # them: auth_failures.py); the total and the last source are in metrics.snapshot().
            "auth_failures_recent": self.auth_failures.recent(),
            "transfers": sum(len(s.transfers) for s in sessions),
            **self.tags.stats(),  # early_expects, early_expect_bytes, early_aborts, refused, tag_owners
            "awaiting_drain": sum(len(s.awaiting_drain) for s in sessions),
            "timers": len(self.channel.timers),
            "dealers": self.channel.dealer_count,
            "unclaimed": len(self.channel.unclaimed),
            "express_links": self.express.links if self.express is not None else 0,
            "express_unbound": self.express.unbound if self.express is not None else 0,
            "warned": len(self._router.warned),
            "watches": sum(r.watching for r in self.runners.values()),
            "handles": sum(pending_handles(d) for d in self.drivers.values()),
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
        for name, driver in list(self.drivers.items()):
            try:
                driver.closing()
            except Exception:
                log.exception("driver %s failed to prepare for closing", name)

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
        close_drivers(self.runners, self.drivers)
        with self._readiness_lock:
            watcher = self._readiness
        if watcher is not None:
            watcher.close()

    def readiness(self) -> ReadinessWatcher:
        """Any thread: the watcher of layer-wise senders' readiness signals (started on first use)."""
        with self._readiness_lock:
            self.check_running()
            if self._readiness is None:
                self._readiness = ReadinessWatcher(self.name)
            return self._readiness

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
        """Any thread: a driver's notice for ``peer``, sent in order (``DriverTraffic``)."""
        self._traffic.queue_notice(peer, payload, driver)

    def check_inbound(self, peer: str, dst: Any, length: Any) -> bool:
        """Driver thread: whether ``peer``'s inbound pieces land in pages announced to it
        (``DriverTraffic.check_inbound``)."""
        return self._traffic.check_inbound(peer, dst, length)

    # -- I/O thread ----------------------------------------------------------------------------

    def receiving(self, session: Session, delta: int) -> None:
        """A receive transfer of ``session`` started (+1) or ended (-1) (``DriverTraffic.receiving``)."""
        self._traffic.receiving(session, delta)

    def next_batch_id(self) -> int:
        """Any thread (``next`` on an ``itertools.count`` is atomic)."""
        return next(self._batch_ids)

    def flush_notices(self) -> None:
        self._traffic.flush_notices()

    def notices_queued_for(self, peer: str) -> bool:
        """Whether a driver notice to ``peer`` waits for the I/O thread to send it."""
        return self._traffic.notices_queued_for(peer)

    def check_lane_identity(self, session: Session, driver: str, info: bytes) -> None:
        self._setup.check_identity(driver, session.peer_endpoint_info(driver), info, of=session)

    def file_session(self, session: Session) -> None:
        """Keep ``session`` under its id and its route."""
        self.sessions[session.id] = session
        self._by_route[session.route] = session

    def queue_incoming(self, session: Session) -> None:
        """``session``, accepted and ready, for the next :meth:`accept`."""
        with self._incoming_cv:
            self._incoming.append(session)
            self._incoming_cv.notify_all()

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

    def on_message(self, route: Route, session: Session, msg: Message) -> None:
        """An authenticated message of ``session`` (the express port's entry; routing.py)."""
        self._router.on_message(route, session, msg)

    def describe(self, route: Route) -> str:
        """``route``'s peer, as the logs name it."""
        session = self._by_route.get(route)
        if session is not None:
            return session.peer_label or session.peer_address
        return str(route[1]) if route[0] == "out" else f"peer {bytes(route[1]).hex()}"
