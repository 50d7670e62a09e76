"""The authentication exchange that admits a peer (docs/security.md): a state machine per side
that does no I/O.

The initiator opens with ``auth`` (its nonce), the acceptor answers ``challenge`` (a cookie: it
keeps nothing for a party that has not proved the secret), the initiator sends ``proof`` (a MAC
over both nonces and the connection id), the acceptor checks it and proves the secret back, and
only then does either side say who it is (``hello``). Each step here takes the message that
arrived and returns what to answer, or the keys of the session; the endpoint's I/O thread sends,
arms the timers and logs. A message that does not fit the exchange raises
:class:`~kvtransport.spi.errors.ProtocolError`; one that fits but fails the proof comes back as
:data:`PROOF_FAILED`, which the caller answers with a refusal.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvtransport.runtime.auth import NONCE_BYTES, ChallengeCookies, Seal, Secret, new_nonce, proof, proof_ok
from kvtransport.spi.errors import ProtocolError

if TYPE_CHECKING:
    from kvtransport.runtime.control import Route
    from kvtransport.runtime.wire import Message


class _ProofFailed:
    def __repr__(self) -> str:
        return "PROOF_FAILED"


#: The peer's proof does not verify under this side's secret (another secret, or none).
PROOF_FAILED: Final = _ProofFailed()


def seals(secret: Secret, conn: str, nonce_i: bytes, nonce_a: bytes, *, initiator: bool) -> tuple[Seal, Seal]:
    """A session's two seals once both sides proved the secret: its control messages', and
    its express stream's."""
    return (
        Seal(secret, conn, nonce_i, nonce_a, initiator=initiator),
        Seal(secret, conn, nonce_i, nonce_a, initiator=initiator, channel=b"express"),
    )


@dataclass
class InitiatorExchange:
    """The initiator's side of one exchange, held by its session: ``auth`` -> ``proof`` -> ``done``."""

    conn: str
    nonce_i: bytes = field(default_factory=new_nonce)
    nonce_a: bytes = b""
    step: str = "auth"

    def opening(self) -> dict[str, Any]:
        """The fields of the ``auth`` message that opens the exchange."""
        return {"conn": self.conn, "nonce": self.nonce_i}

    def on_challenge(self, secret: Secret, msg: Message) -> dict[str, Any]:
        """The acceptor's cookie arrived: the fields of this side's ``proof``."""
        nonce_a = msg["nonce"]
        if self.step != "auth" or msg["conn"] != self.conn or len(nonce_a) != NONCE_BYTES:
            raise ProtocolError("unexpected challenge")
        self.nonce_a = nonce_a
        self.step = "proof"
        mac = proof(secret, "initiator", self.conn, self.nonce_i, nonce_a)
        return {"conn": self.conn, "nonce_i": self.nonce_i, "nonce_a": nonce_a, "mac": mac}

    def on_proof(self, secret: Secret, msg: Message) -> tuple[Seal, Seal] | _ProofFailed:
        """The acceptor's proof arrived: the session's seals, or :data:`PROOF_FAILED`."""
        if (
            self.step != "proof"
            or msg["conn"] != self.conn
            or msg["nonce_i"] != self.nonce_i
            or msg["nonce_a"] != self.nonce_a
        ):
            raise ProtocolError("unexpected proof")
        if not proof_ok(secret, "acceptor", self.conn, self.nonce_i, self.nonce_a, msg["mac"]):
            return PROOF_FAILED
        self.step = "done"
        return seals(secret, self.conn, self.nonce_i, self.nonce_a, initiator=True)


class PendingAuth:
    """Acceptor side of a route whose initiator proved the secret, until its hello. (Before
    the proof nothing is kept: the challenge is a cookie, see ``ChallengeCookies``.)"""

    __slots__ = ("conn", "express_seal", "seal", "timer")

    def __init__(self, conn: str, seal: Seal, express_seal: Seal) -> None:
        self.conn = conn
        self.seal = seal
        self.express_seal = express_seal
        self.timer: Any = None  # the caller's: when it forgets the entry (``Acceptor.expire``)


@dataclass(frozen=True)
class Admitted:
    """The initiator proved the secret: ``entry`` is kept for its hello, ``answer`` holds the
    fields of this side's ``proof``, and ``evicted`` the entries dropped to make room (the
    oldest that never said hello: their timers are the caller's to cancel)."""

    entry: PendingAuth
    answer: dict[str, Any]
    evicted: list[PendingAuth]


class Acceptor:
    """The acceptor's side of every exchange at one endpoint: at most ``max_pending`` admitted
    initiators waiting for their hello, and none for a party that has not proved the secret."""

    def __init__(self, secret: Secret, max_pending: int, cookie_ttl: float) -> None:
        self.secret = secret
        self.max_pending = max_pending
        self.cookie_ttl = cookie_ttl
        self.pending: collections.OrderedDict[Route, PendingAuth] = collections.OrderedDict()
        self._cookies = ChallengeCookies()

    def on_auth(self, route: Route, msg: Message, *, carries_session: bool) -> dict[str, Any]:
        """A peer opens an exchange: the fields of the ``challenge``. It learns one nonce (a
        cookie), nothing else, and this side keeps nothing."""
        if carries_session or route[0] != "in" or route in self.pending:
            raise ProtocolError("auth on a route that already authenticated or carries a connection")
        if len(msg["nonce"]) != NONCE_BYTES:
            raise ProtocolError(f"auth nonce of {len(msg['nonce'])} bytes, expected {NONCE_BYTES}")
        return {"conn": msg["conn"], "nonce": self._cookies.issue(bytes(route[1]), msg["conn"], msg["nonce"])}

    def on_proof(self, route: Route, msg: Message) -> Admitted | _ProofFailed:
        """The initiator's proof: :class:`Admitted` (this side proves the secret back), or
        :data:`PROOF_FAILED` (refuse it). Only a verified initiator is remembered."""
        conn, nonce_i, nonce_a = msg["conn"], msg["nonce_i"], msg["nonce_a"]
        if route[0] != "in" or route in self.pending:
            raise ProtocolError("proof on a route that already authenticated")
        if not self._cookies.valid(bytes(route[1]), conn, nonce_i, nonce_a, self.cookie_ttl):
            raise ProtocolError("proof for a challenge this endpoint did not issue to this peer (or too old)")
        if not proof_ok(self.secret, "initiator", conn, nonce_i, nonce_a, msg["mac"]):
            return PROOF_FAILED
        evicted = []
        while len(self.pending) >= self.max_pending:
            # Only holders of the secret get here: the oldest of them that never said hello goes.
            evicted.append(self.pending.popitem(last=False)[1])
        entry = PendingAuth(conn, *seals(self.secret, conn, nonce_i, nonce_a, initiator=False))
        self.pending[route] = entry
        mac = proof(self.secret, "acceptor", conn, nonce_i, nonce_a)
        return Admitted(entry, {"conn": conn, "nonce_i": nonce_i, "nonce_a": nonce_a, "mac": mac}, evicted)

    def expire(self, route: Route, entry: PendingAuth) -> None:
        """``entry``'s time to say hello ran out (nothing changes if it already left)."""
        if self.pending.get(route) is entry:
            del self.pending[route]

    def take(self, route: Route) -> PendingAuth | None:
        """The admitted entry of ``route``, no longer pending (its hello was accepted)."""
        return self.pending.pop(route, None)
