"""How a session comes to be ready, on either side: the initiator's connect (its session, the
first message of the authentication exchange, the caller's wait and giving up), its hello once
the acceptor proved the secret and its answer to the welcome; the acceptor's answer to a hello;
the lanes of a decision and the checks of the peer's identity on them, their driver connects
under the connect timeout; then the ready session's heartbeats.

The parsing and deciding are :mod:`~kvtransport.negotiation.handshake`'s (pure). The endpoint
is a :class:`SetupHost`; this module imports nothing of it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvtransport.negotiation.handshake import (
    check_agreement,
    decide,
    decision_to_dict,
    label_of,
    read_peer,
    regions_to_dict,
)
from kvtransport.negotiation.hello import DriverHello, Hello
from kvtransport.negotiation.negotiate import Decision
from kvtransport.runtime.admission import Acceptor, InitiatorExchange, PendingAuth
from kvtransport.runtime.control import Route
from kvtransport.runtime.express import ExpressPort
from kvtransport.runtime.handles import Connection
from kvtransport.runtime.lane import Lane, LanePicker
from kvtransport.runtime.runner import DriverRunner
from kvtransport.runtime.session import Phase, Session, SessionHost
from kvtransport.runtime.wire import Message, encode
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import (
    ConnectError,
    DriverError,
    KVTransportError,
    NegotiationError,
    PeerLost,
    ProtocolError,
)
from kvtransport.spi.memory import RegionSet

log = logging.getLogger(__name__)


class SetupHost(SessionHost, Protocol):
    """What setting a session up needs of the endpoint, beyond what the session itself does:
    this side's hello, its open drivers and their runners, its sessions, the express port,
    and the session tables' entries (filing a session, the accept queue)."""

    pending_handshakes: int

    @property
    def hello(self) -> Hello: ...

    @property
    def classes(self) -> Mapping[str, type[KVTransport]]: ...

    @property
    def drivers(self) -> Mapping[str, KVTransport]: ...

    @property
    def runners(self) -> Mapping[str, DriverRunner]: ...

    @property
    def sessions(self) -> Mapping[str, Session]: ...

    @property
    def express(self) -> ExpressPort[Session] | None: ...

    def describe(self, route: Route) -> str: ...

    def file_session(self, session: Session) -> None:
        """Keep ``session`` under its id and its route."""

    def queue_incoming(self, session: Session) -> None:
        """``session``, accepted and ready, for the next :meth:`accept`."""


class SessionSetup:
    """The handshake of every session of one endpoint (I/O thread, except :meth:`connect`)."""

    def __init__(
        self, endpoint: SetupHost, admission: Acceptor, own: Mapping[str, DriverHello], regions: RegionSet
    ) -> None:
        self._endpoint = endpoint
        self._admission = admission
        #: This endpoint's driver entries, with the connection info each open driver gave.
        self._own = own
        self._regions_doc = regions_to_dict(regions)

    # -- initiator ---------------------------------------------------------------------------

    def connect(self, address: str, timeout: float | None = None) -> Connection:
        """Any thread: see :meth:`Endpoint.connect <kvtransport.runtime.endpoint.Endpoint.connect>`."""
        endpoint = self._endpoint
        timeout = endpoint.timeouts.connect if timeout is None else timeout
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
                    if len(endpoint.sessions) >= endpoint.limits.max_connections:
                        raise ConnectError(
                            f"{endpoint.name} already has {len(endpoint.sessions)} connections "
                            "(KVTRANSPORT_MAX_CONNECTIONS)"
                        )
                    try:
                        route = endpoint.channel.connect(address, conn_id)
                    except Exception as exc:
                        raise ConnectError(f"cannot connect to {address!r}: {exc}") from exc
                    session = Session(endpoint, conn_id, route, address, address, initiator=True)
                    endpoint.file_session(session)
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
                    endpoint.call(
                        lambda: endpoint.end_session(
                            made, ConnectError(f"gave up connecting to {address}"), notify=True
                        )
                    )

        try:
            endpoint.call(start)
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
            endpoint.call(
                lambda: endpoint.end_session(session, ConnectError(f"gave up connecting to {address}"), notify=False)
            )
            raise ConnectError(f"no handshake answer from {address} within {timeout} s (is an endpoint listening?)")
        if session.phase is not Phase.READY:
            raise session.error or ConnectError(f"connection to {address} failed")
        return session.handle

    def send_hello(self, session: Session) -> None:
        """Initiator, once the acceptor proved the secret (never before): who this side is,
        with the receive side each ``receives_per_peer`` driver made for this connection (any
        of them may be chosen: the decision is the acceptor's answer)."""
        names = [n for n, d in self._endpoint.drivers.items() if type(d).receives_per_peer]

        def hello(infos: dict[str, bytes]) -> None:
            if session.phase is Phase.CLOSED:
                return
            session.send(
                "hello", conn=session.id, hello=self._endpoint.hello.to_dict(), regions=self._regions_doc, lanes=infos
            )

        self._receive_infos(session, names, hello)

    def _receive_infos(self, session: Session, names: list[str], then: Callable[[dict[str, bytes]], None]) -> None:
        """Ask each driver in ``names`` (on its thread) for the receive side it makes for
        ``session`` alone; ``then(infos)`` on the I/O thread once all answered. A driver that
        fails is left out (its endpoint-wide info serves the connection, and its fence then
        cannot cut this peer off alone: it says so)."""
        if not names:
            then({})
            return
        endpoint = self._endpoint
        left = [len(names)]

        def one(name: str, info: Any, error: KVTransportError | None) -> None:
            if error is not None:
                log.warning(
                    "%s: %s could not make a receive side for %s: %s", endpoint.name, name, session.peer_label, error
                )
            elif isinstance(info, bytes) and info:
                session.receive_infos[name] = info
            left[0] -= 1
            if not left[0]:
                then(dict(session.receive_infos))

        for name in names:
            session.receivers_asked.add(name)
            try:
                endpoint.runners[name].call(
                    functools.partial(endpoint.drivers[name].receive_info, session.id), functools.partial(one, name)
                )
            except KVTransportError as exc:
                one(name, None, exc)

    def on_welcome(self, session: Session, msg: Message, replay: Callable[[Session, list[Message]], None]) -> None:
        """Initiator: the acceptor's answer. Once this side's lanes connected the session is
        ready and ``replay`` runs what the acceptor said meanwhile."""
        endpoint = self._endpoint
        if session.decision is not None:
            raise ProtocolError("a second welcome")
        try:
            peer_hello, peer_regions = read_peer(msg["hello"], msg["regions"])
            session.peer_label = label_of(peer_hello)
            session.peer_hello = peer_hello
            decision = decide(endpoint.hello, peer_hello, endpoint.classes)
            check_agreement(msg["decision"], decision, session.peer_label)
            lanes = self._lanes(session.id, decision, peer_hello, msg["lanes"])
        except KVTransportError as exc:
            session.send("bye", reason=f"handshake failed: {exc}")
            endpoint.end_session(session, exc, notify=False)
            return
        session.decision, session.peer_regions, session.lanes = decision, peer_regions, lanes
        session.picker = LanePicker(list(lanes.values()))
        session.release_receivers(set(lanes))  # the receive sides of drivers not chosen
        session.held = []
        if endpoint.express is not None and msg["express"]:
            endpoint.express.dial(session, msg["express"])

        def connected(_: Any, error: KVTransportError | None) -> None:
            held, session.held = session.held or [], None
            if session.phase is Phase.CLOSED:
                return
            if error is not None:
                session.send("bye", reason=f"handshake failed: {error}")
                endpoint.end_session(session, error, notify=False)
                return
            self._ready(session)
            log.info("connected %s to %s: %s", session.id[:8], session.peer_label, decision.summary())
            replay(session, held)

        self._connect_lanes(session, peer_regions, connected)

    # -- acceptor ----------------------------------------------------------------------------

    def on_hello(self, route: Route, auth: PendingAuth, msg: Message) -> None:
        """Acceptor: an authenticated initiator's hello; the welcome once the lanes connected."""
        endpoint = self._endpoint
        conn_id = msg["conn"]
        seal = auth.seal
        assert seal is not None

        def refuse(reason: str) -> None:
            log.warning("refusing connection from %s: %s", endpoint.describe(route), reason)
            endpoint.channel.send(
                route, seal.seal(encode("refuse", endpoint.max_message_bytes, conn=conn_id, reason=reason))
            )

        if conn_id != auth.conn:
            refuse("the hello's connection id is not the one authenticated")
            return
        if conn_id in endpoint.sessions:
            refuse(f"connection id {conn_id[:16]!r} is in use")
            return
        if len(endpoint.sessions) >= endpoint.limits.max_connections:
            refuse(f"{endpoint.name} has {len(endpoint.sessions)} connections, its limit (KVTRANSPORT_MAX_CONNECTIONS)")
            return
        if endpoint.pending_handshakes >= endpoint.limits.max_pending_handshakes:
            refuse(f"{endpoint.name} is busy with {endpoint.pending_handshakes} handshakes; try again")
            return
        try:
            peer_hello, peer_regions = read_peer(msg["hello"], msg["regions"])
            decision = decide(peer_hello, endpoint.hello, endpoint.classes)
            lanes = self._lanes(conn_id, decision, peer_hello, msg["lanes"])
        except KVTransportError as exc:
            refuse(f"{type(exc).__name__}: {exc}")
            return
        session = Session(endpoint, conn_id, route, label_of(peer_hello), "", initiator=False)
        session.seal = seal
        session.express_seal = auth.express_seal
        session.peer_hello = peer_hello
        self._admission.take(route)
        endpoint.channel.timers.cancel(auth.timer)
        session.decision, session.peer_regions, session.lanes = decision, peer_regions, lanes
        session.picker = LanePicker(list(lanes.values()))
        endpoint.file_session(session)
        endpoint.channel.claim(route)
        endpoint.pending_handshakes += 1

        def welcome(infos: dict[str, bytes]) -> None:
            if session.phase is Phase.CLOSED:
                return
            session.send(
                "welcome",
                conn=conn_id,
                hello=endpoint.hello.to_dict(),
                regions=self._regions_doc,
                decision=decision_to_dict(decision),
                express=endpoint.express.port if endpoint.express is not None else 0,
                lanes=infos,
            )
            self._ready(session)
            log.info("accepted %s from %s: %s", conn_id[:8], session.peer_label, decision.summary())
            endpoint.queue_incoming(session)

        def connected(_: Any, error: KVTransportError | None) -> None:
            endpoint.pending_handshakes -= 1
            if session.phase is Phase.CLOSED:
                return
            if error is not None:
                refuse(f"{type(error).__name__}: {error}")
                endpoint.end_session(session, error, notify=False)
                return
            # This side's own receive sides, for the chosen lanes only (the decision is known).
            self._receive_infos(
                session, [n for n, lane in lanes.items() if type(lane.driver).receives_per_peer], welcome
            )

        self._connect_lanes(session, peer_regions, connected)

    # -- either side -------------------------------------------------------------------------

    def _lanes(
        self, conn_id: str, decision: Decision, peer_hello: Hello, peer_lanes: Mapping[str, bytes]
    ) -> dict[str, Lane]:
        """A lane per driver of the decision (the chosen one first): the open driver, its
        runner, and the peer's (checked) connection info for it: the receive side it made
        for this connection (``peer_lanes``), else its endpoint-wide one."""
        lanes: dict[str, Lane] = {}
        for name in decision.lanes or (decision.driver,):
            driver = self._endpoint.drivers.get(name)
            entry = peer_hello.drivers.get(name)
            if driver is None or entry is None:
                raise NegotiationError(f"{name} was chosen but is not open on both sides")
            info = peer_lanes.get(name, entry.conn)
            self.check_identity(name, entry.conn, info)
            lanes[name] = Lane(
                name,
                driver,
                self._endpoint.runners[name],
                info,
                decision.models_of(name),
                chosen=name == decision.driver,
                standby=name in decision.standby,
                key=conn_id,
            )
        return lanes

    def check_identity(self, driver: str, endpoint_info: Any, lane_info: Any, of: object = None) -> None:
        """The engine identity this side will write to (``lane_info``: the receive side the
        peer made for this connection, or its endpoint-wide info) is the peer's own: not this
        endpoint's (a mirror would make this side write into its own pool: endpoint-wide, or a
        receive side it made for some peer) and not that of a live connection (a replayed hello
        would direct writes into someone else's memory). A peer's endpoint-wide info may be
        that of a live connection when its receive side is a new one: the same endpoint
        connecting again while its old connection is still being given up. ``of``: the session
        whose lane comes back from quarantine (its own lane's info is not another's)."""
        if not isinstance(endpoint_info, bytes) or not isinstance(lane_info, bytes):
            raise ProtocolError("the peer's driver connection info is not bytes")
        mine = {self._own[driver].conn}
        theirs: dict[bytes, str] = {}
        for other in self._endpoint.sessions.values():
            if driver in other.receive_infos:
                mine.add(other.receive_infos[driver])
            lane = other.lanes.get(driver)
            if lane is not None and other is not of:
                theirs[lane.peer_info] = other.peer_label
        for info in {endpoint_info, lane_info}:
            if info and info in mine:
                raise NegotiationError(f"the peer presented this endpoint's own {driver} connection info")
        if lane_info and lane_info in theirs:
            raise NegotiationError(f"another live connection ({theirs[lane_info]}) has this {driver} identity")

    def _connect_lanes(
        self,
        session: Session,
        peer_regions: RegionSet,
        then: Callable[[Any, KVTransportError | None], None],
    ) -> None:
        """``driver.connect`` of every lane on its driver's thread (it may block on the
        engine), all bounded by the connect timeout; ``then`` runs on the I/O thread once every
        lane answered (with the first error), or when the timeout passes."""
        endpoint = self._endpoint
        conn_id, lanes = session.id, list(session.lanes.values())
        answered = [False]
        left = [len(lanes)]
        first: list[KVTransportError] = []

        def finish(error: KVTransportError | None) -> None:
            if not answered[0]:
                answered[0] = True
                endpoint.channel.timers.cancel(session.handshake_timer)
                then(None, error)

        def one(lane: Lane, _: Any, error: KVTransportError | None) -> None:
            if error is not None and (lane.learning or lane.standby) and not lane.chosen:
                # A lane kept only to learn from, or to fail over to: the connection goes on
                # without it.
                lane.failed(f"its connect failed: {error}", session.peer_label)
                error = None
            if error is not None:
                first.append(error)
            left[0] -= 1
            if left[0] == 0 or error is not None:
                finish(first[0] if first else None)

        names = ", ".join(lane.name for lane in lanes)
        session.handshake_timer = endpoint.channel.timers.call_later(
            endpoint.timeouts.connect,
            lambda: finish(DriverError(f"connect() of {names} took longer than {endpoint.timeouts.connect} s")),
        )
        for lane in lanes:
            # From here the driver may know the peer: closing the session disconnects it (queued
            # behind this connect, so it runs after it whatever the order of events).
            lane.connect_queued = True
            driver, info = lane.driver, lane.peer_info
            lane.runner.call(
                functools.partial(driver.connect, conn_id, info, peer_regions), functools.partial(one, lane)
            )

    def _ready(self, session: Session) -> None:
        session.phase = Phase.READY
        session.last_seen = time.monotonic()
        self._schedule_heartbeat(session)
        session.ready.set()

    def _schedule_heartbeat(self, session: Session) -> None:
        endpoint = self._endpoint

        def beat() -> None:
            if session.phase is not Phase.READY:
                return
            now = time.monotonic()
            silent = now - session.last_seen
            if silent > endpoint.timeouts.heartbeat_timeout:
                endpoint.end_session(
                    session,
                    PeerLost(
                        f"peer {session.peer_label} stopped answering: no message for {silent:.1f} s "
                        f"(heartbeat timeout {endpoint.timeouts.heartbeat_timeout} s)"
                    ),
                    notify=False,
                )
                return
            session.send("ping", seq=int(now * 1000))
            session.heartbeat = endpoint.channel.timers.call_later(endpoint.timeouts.heartbeat_interval, beat)

        session.heartbeat = endpoint.channel.timers.call_later(endpoint.timeouts.heartbeat_interval, beat)
