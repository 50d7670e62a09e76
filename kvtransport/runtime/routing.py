"""Frames in: what arrives on the control channel (and, through :meth:`Router.on_message`, on
the express streams) is unsealed and authenticated, the authentication exchange is answered
(docs/security.md; the primitives are in auth.py, its state machines in admission.py), and each
message goes to its session or to the handshake. Strangers are dropped and logged rate-limited;
a peer that breaks the protocol fails the transfer it named and earns a strike.

:class:`Router` knows the endpoint as a :class:`RouterHost` and the handshake
(``runtime.session_setup``) as a :class:`Handshake`; it imports neither.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvtransport.runtime.admission import Acceptor, Admitted, PendingAuth
from kvtransport.runtime.auth import MAX_UNSEALED_BYTES, RateLimitedLog, Secret, is_sealed
from kvtransport.runtime.auth_failures import AuthFailures
from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.config import Limits, Timeouts
from kvtransport.runtime.control import ControlChannel, Route
from kvtransport.runtime.session import Phase, Session
from kvtransport.runtime.wire import Message, decode, encode
from kvtransport.spi.errors import (
    AuthenticationFailed,
    KVTransportError,
    NegotiationError,
    PeerLost,
    ProtocolError,
)

log = logging.getLogger(__name__)

#: Protocol violations a session may commit before it is closed.
MAX_STRIKES = 16
#: Messages kept for an initiator between the welcome and its own driver connect.
MAX_HELD = 4096
#: What a peer that failed authentication is told, and nothing more.
AUTH_FAILED = "authentication failed"

#: Runs the messages an initiator held during its handshake, once it is ready.
Replay = Callable[[Session, list[Message]], None]


class Handshake(Protocol):
    """What routing hands to the handshake (``runtime.session_setup.SessionSetup``)."""

    def on_hello(self, route: Route, auth: PendingAuth, msg: Message) -> None:
        """Acceptor: an authenticated initiator's hello."""

    def on_welcome(self, session: Session, msg: Message, replay: Replay) -> None:
        """Initiator: the acceptor's welcome; ``replay`` runs what was held once ready."""

    def send_hello(self, session: Session) -> None:
        """Initiator: the acceptor proved the secret; say who this side is."""


class RouterHost(Protocol):
    """What routing needs of the endpoint: the secret, the channel to answer on, its settings,
    where failed authentications are counted, how the logs name a route, and ending a session."""

    secret: Secret
    auth_failures: AuthFailures
    channel: ControlChannel
    timeouts: Timeouts
    limits: Limits
    max_message_bytes: int

    def describe(self, route: Route) -> str: ...

    def end_session(self, session: Session, error: KVTransportError, *, notify: bool) -> None: ...


class Router:
    """Every frame and message into the endpoint, on the I/O thread."""

    def __init__(
        self,
        endpoint: RouterHost,
        handshake: Handshake,
        admission: Acceptor,
        by_route: Mapping[Route, Session],
        ended_lately: Callable[[Route], bool],
    ) -> None:
        self._endpoint = endpoint
        self._handshake = handshake
        #: The acceptor's side of the authentication exchange (admission.py: no I/O there).
        self._admission = admission
        #: The endpoint's sessions by route, and whether a route's session ended moments ago.
        self._by_route = by_route
        self._ended_lately = ended_lately
        self._auth_log = RateLimitedLog(log)
        #: Peers warned about once (further problems from them are logged at DEBUG), bounded.
        self.warned: collections.OrderedDict[Any, None] = collections.OrderedDict()

    def on_frame(self, route: Route, frame: bytes) -> None:
        session = self._by_route.get(route)
        if is_sealed(frame):
            self._on_sealed(route, session, frame)
            return
        describe, max_message_bytes = self._endpoint.describe, self._endpoint.max_message_bytes
        # Unsealed: only the authentication exchange (and a refusal) travels in the clear.
        if len(frame) > MAX_UNSEALED_BYTES:
            self._stranger(route, f"dropped an unsealed frame of {len(frame)} bytes from {describe(route)}")
            return
        try:
            msg = decode(frame, limit=max_message_bytes)
        except ProtocolError as exc:
            self._stranger(route, f"bad unauthenticated control message from {describe(route)}: {exc}")
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
                self._stranger(route, f"hello from {describe(route)} without authentication")
                self._endpoint.channel.send(
                    route, encode("refuse", max_message_bytes, conn=msg["conn"], reason=AUTH_FAILED)
                )
            elif msg.type == "refuse" and session is not None and session.initiator:
                reason = msg["reason"]
                error: KVTransportError = (
                    AuthenticationFailed(
                        f"{session.peer_address} refused the connection: authentication failed (this side's "
                        f"secret: {self._endpoint.secret.source}; every process of a deployment needs the same "
                        "secret)"
                    )
                    if reason == AUTH_FAILED
                    else NegotiationError(f"{session.peer_address} refused the connection: {reason}")
                )
                self._endpoint.end_session(session, error, notify=False)
            else:
                self._stranger(route, f"unauthenticated {msg.type} message from {describe(route)}")
        except KVTransportError as exc:
            self._stranger(route, f"invalid {msg.type} message from {describe(route)}: {exc}")

    def _on_sealed(self, route: Route, session: Session | None, frame: bytes) -> None:
        describe = self._endpoint.describe
        pending = None
        if session is not None:
            seal = session.seal
        else:
            pending = self._admission.pending.get(route)
            seal = pending.seal if pending is not None else None
        if seal is None:
            if self._ended_lately(route):
                log.debug("dropped a sealed frame from %s, whose session just ended", describe(route))
                return
            self._stranger(route, f"sealed message from {describe(route)}, which has not authenticated")
            return
        body = seal.open(frame)
        if body is None:
            self._stranger(
                route,
                f"dropped a control message for {describe(route)} that failed authentication "
                "(forged, replayed or corrupted)",
            )
            return
        if session is not None:
            session.last_seen = time.monotonic()
        try:
            msg = decode(body, limit=self._endpoint.max_message_bytes)
        except ProtocolError as exc:
            self._violation(route, session, f"bad control message from {describe(route)}: {exc}")
            return
        if pending is not None:
            if msg.type != "hello":
                self._warn_once(route, f"{msg.type} message from {describe(route)} before its hello")
                return
            try:
                self._handshake.on_hello(route, pending, msg)
            except Exception:
                log.exception("kvtransport: handling a hello from %s failed", describe(route))
            return
        assert session is not None
        self.on_message(route, session, msg)

    def on_message(self, route: Route, session: Session, msg: Message) -> None:
        """An authenticated message of ``session``."""
        describe = self._endpoint.describe
        if session.held is not None and msg.type not in ("welcome", "refuse", "ping"):
            # Initiator between welcome and its driver's connect: the acceptor is ready and may
            # already talk; keep what it says for when this side is ready too.
            if len(session.held) < MAX_HELD:
                session.held.append(msg)
            else:
                self._violation(route, session, f"{describe(route)} sent {MAX_HELD} messages during the handshake")
            return
        try:
            if msg.type == "hello":
                session.send("refuse", conn=msg["conn"], reason="this socket already carries a connection")
            else:
                self._dispatch(session, msg)
        except KVTransportError as exc:
            self._violation(route, session, f"invalid {msg.type} message from {describe(route)}: {exc}", msg)
        except Exception as exc:
            # A bug of ours (or a driver's) on this message: this session can no longer be
            # trusted to be in a consistent state, every other one can.
            log.exception("kvtransport: handling a %s message from %s failed", msg.type, describe(route))
            self._endpoint.end_session(
                session, ProtocolError(f"internal error on a {msg.type} message: {type(exc).__name__}"), notify=True
            )

    def _replay(self, session: Session, held: list[Message]) -> None:
        """Initiator, now ready: what the acceptor said between its welcome and this side's
        connect, in order."""
        for early in held:
            if session.closed:
                break  # one of them ended it: the rest must not claim tags for a dead session
            try:
                self._dispatch(session, early)
            except KVTransportError as exc:
                self._violation(session.route, session, f"invalid {early.type} message: {exc}", early)

    # -- authentication (docs/security.md; the primitives are in auth.py) ---------------------

    def _on_auth(self, route: Route, session: Session | None, msg: Message) -> None:
        """Acceptor: a peer opens an exchange; it gets a challenge and this side keeps nothing."""
        challenge = self._admission.on_auth(route, msg, carries_session=session is not None)
        self._endpoint.channel.send(route, encode("challenge", self._endpoint.max_message_bytes, **challenge))

    def _on_challenge(self, session: Session, msg: Message) -> None:
        """Initiator: prove the secret, bound to both nonces and the connection id."""
        if session.exchange is None:
            raise ProtocolError("unexpected challenge")
        session.send("proof", **session.exchange.on_challenge(self._endpoint.secret, msg))

    def _on_initiator_proof(self, route: Route, msg: Message) -> None:
        """Acceptor: the initiator proved the secret (or not); prove it back. Only a verified
        initiator is remembered (until its hello, or the connect timeout)."""
        endpoint = self._endpoint
        outcome = self._admission.on_proof(route, msg)
        if not isinstance(outcome, Admitted):
            # Counted by the source address the transport reports (the peer's own words are
            # untrusted), and warned about once per window, not per attempt (auth_failures.py).
            address = endpoint.channel.peer_address()
            endpoint.auth_failures.record(address or endpoint.describe(route))
            endpoint.channel.send(
                route, encode("refuse", endpoint.max_message_bytes, conn=msg["conn"], reason=AUTH_FAILED)
            )
            return
        timers = endpoint.channel.timers
        for old in outcome.evicted:
            timers.cancel(old.timer)
        outcome.entry.timer = timers.call_later(
            endpoint.timeouts.connect, functools.partial(self._admission.expire, route, outcome.entry)
        )
        endpoint.channel.send(route, encode("proof", endpoint.max_message_bytes, **outcome.answer))

    def _on_acceptor_proof(self, session: Session, msg: Message) -> None:
        """Initiator: the acceptor proved the secret; only now does this side say who it is."""
        secret = self._endpoint.secret
        if session.exchange is None:
            raise ProtocolError("unexpected proof")
        outcome = session.exchange.on_proof(secret, msg)
        if not isinstance(outcome, tuple):
            self._auth_log.warning(
                "%s did not prove it holds this deployment's secret (%s)", session.peer_address, secret.source
            )
            self._endpoint.end_session(
                session,
                AuthenticationFailed(
                    f"authentication failed: {session.peer_address} did not prove it holds this deployment's "
                    f"secret (this side's: {secret.source}); is it a kvtransport endpoint of this deployment?"
                ),
                notify=False,
            )
            return
        session.seal, session.express_seal = outcome
        self._handshake.send_hello(session)

    # -- strangers and violations --------------------------------------------------------------

    def _stranger(self, route: Route, text: str) -> None:
        """Something from a party that has not authenticated: dropped, logged rate-limited,
        no strike (it could not have come from the session's peer)."""
        self._auth_log.warning("%s", text)

    def _violation(self, route: Route, session: Session | None, text: str, msg: Message | None = None) -> None:
        """A peer broke the protocol: fail the transfer it named, count a strike on its session."""
        self._warn_once(route, text)
        if session is None or session.phase is Phase.CLOSED:
            return
        tag = getattr(msg, "tag", None)
        t = session.transfers.get(tag) if isinstance(tag, str) else None
        if t is not None and not t.state.final:
            session.abort(t, text, notify=True, error=ProtocolError(text))
        session.strikes += 1
        if session.strikes >= MAX_STRIKES:
            session.send("bye", reason=f"{MAX_STRIKES} protocol violations")
            self._endpoint.end_session(
                session, ProtocolError(f"{session.peer_label}: {MAX_STRIKES} protocol violations"), notify=False
            )

    def _dispatch(self, session: Session, msg: Message) -> None:
        kind = msg.type
        if session.phase is Phase.HANDSHAKE:
            if kind == "welcome" and session.initiator:
                self._handshake.on_welcome(session, msg, self._replay)
            elif kind == "refuse" and session.initiator:
                self._endpoint.end_session(
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
        elif kind == "lane_down":
            session.failover.on_lane_down(msg)
        elif kind == "lane_reopen":
            session.failover.on_lane_reopen(msg)
        elif kind == "lane_reopened":
            session.failover.on_lane_reopened(msg)
        elif kind == "bye":
            self._endpoint.end_session(
                session, PeerLost(f"peer {session.peer_label} closed its endpoint ({msg['reason']})"), notify=False
            )
        elif kind in ("hello", "welcome", "refuse", "auth", "challenge", "proof"):
            raise ProtocolError(f"{kind} on a connection that is already open")
        # "ping" needs nothing beyond last_seen

    def _warn_once(self, route: Route, text: str) -> None:
        key = route[1] if route[0] == "in" else route
        if key not in self.warned:
            put_newest(self.warned, key, None, self._endpoint.limits.max_warned_peers)
            log.warning("%s (further problems from this peer are logged at DEBUG)", text)
        else:
            log.debug("%s", text)
