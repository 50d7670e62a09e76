"""The authentication exchange (runtime/admission.py) with no socket: both sides' state
machines fed each other's messages, or a stranger's. The endpoint-level tests (test_security,
test_hostile) run the same code behind real sockets."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtransport.runtime.admission import PROOF_FAILED, Acceptor, Admitted, InitiatorExchange
from kvtransport.runtime.auth import NONCE_BYTES, Secret, load_secret
from kvtransport.runtime.wire import TYPES, Message, message
from kvtransport.spi.errors import ProtocolError

SECRET = load_secret("a" * 64)
OTHER = load_secret("b" * 64)
ROUTE = ("in", b"peer-1")


def msg(kind: str, fields: dict[str, Any]) -> Message:
    """A message of ``kind`` with those of ``fields`` its type has (their values unchecked)."""
    return message(kind, **{k: v for k, v in fields.items() if k in TYPES[kind].__struct_fields__})


def exchange(initiator_secret: Secret, acceptor: Acceptor, route: tuple[str, bytes] = ROUTE) -> Any:
    """Run a whole exchange; what the initiator ends with (seals, or PROOF_FAILED), or the
    acceptor's refusal."""
    side = InitiatorExchange("conn-1")
    challenge = acceptor.on_auth(route, msg("auth", side.opening()), carries_session=False)
    answer = side.on_challenge(initiator_secret, msg("challenge", challenge))
    admitted = acceptor.on_proof(route, msg("proof", answer))
    if not isinstance(admitted, Admitted):
        return admitted
    return side.on_proof(initiator_secret, msg("proof", admitted.answer))


def test_two_holders_of_the_secret_end_with_matching_seals() -> None:
    acceptor = Acceptor(SECRET, max_pending=4, cookie_ttl=10)
    seal, express_seal = exchange(SECRET, acceptor)
    entry = acceptor.take(ROUTE)
    assert entry is not None and entry.conn == "conn-1"
    # What one side seals, the other opens; the two channels' keys differ.
    assert entry.seal.open(seal.seal(b"hello")) == b"hello"
    assert entry.express_seal.open(express_seal.seal(b"done")) == b"done"
    assert entry.seal.open(express_seal.seal(b"x")) is None


def test_an_initiator_without_the_secret_is_refused_and_nothing_is_kept() -> None:
    acceptor = Acceptor(SECRET, max_pending=4, cookie_ttl=10)
    assert exchange(OTHER, acceptor) is PROOF_FAILED
    assert not acceptor.pending


def test_an_acceptor_without_the_secret_is_found_out_by_the_initiator() -> None:
    impostor = Acceptor(OTHER, max_pending=4, cookie_ttl=10)
    side = InitiatorExchange("conn-1")
    challenge = impostor.on_auth(ROUTE, msg("auth", side.opening()), carries_session=False)
    answer = side.on_challenge(SECRET, msg("challenge", challenge))
    # The impostor cannot verify the proof; suppose it answers anyway with its own.
    forged = dict(answer, mac=b"\0" * len(answer["mac"]))
    assert side.on_proof(SECRET, msg("proof", forged)) is PROOF_FAILED
    assert side.step == "proof"


def test_a_proof_is_bound_to_the_route_its_challenge_was_issued_to() -> None:
    acceptor = Acceptor(SECRET, max_pending=4, cookie_ttl=10)
    side = InitiatorExchange("conn-1")
    challenge = acceptor.on_auth(ROUTE, msg("auth", side.opening()), carries_session=False)
    answer = side.on_challenge(SECRET, msg("challenge", challenge))
    with pytest.raises(ProtocolError, match="did not issue"):
        acceptor.on_proof(("in", b"someone-else"), msg("proof", answer))
    assert isinstance(acceptor.on_proof(ROUTE, msg("proof", answer)), Admitted)
    with pytest.raises(ProtocolError, match="already authenticated"):  # replayed on the same route
        acceptor.on_proof(ROUTE, msg("proof", answer))


def test_admitted_initiators_are_bounded_oldest_first() -> None:
    acceptor = Acceptor(SECRET, max_pending=2, cookie_ttl=10)
    routes = [("in", f"peer-{i}".encode()) for i in range(3)]
    for route in routes:
        exchange(SECRET, acceptor, route)
    assert list(acceptor.pending) == routes[1:]
    entry = acceptor.pending[routes[1]]
    acceptor.expire(routes[1], entry)
    acceptor.expire(routes[1], entry)  # twice, or after its hello: nothing changes
    assert list(acceptor.pending) == routes[2:]


def test_out_of_order_messages_are_protocol_errors() -> None:
    side = InitiatorExchange("conn-1")
    with pytest.raises(ProtocolError):
        side.on_proof(SECRET, msg("proof", {"conn": "conn-1", "nonce_i": side.nonce_i, "nonce_a": b"", "mac": b""}))
    with pytest.raises(ProtocolError):
        side.on_challenge(SECRET, msg("challenge", {"conn": "another", "nonce": b"\0" * NONCE_BYTES}))
    acceptor = Acceptor(SECRET, max_pending=2, cookie_ttl=10)
    with pytest.raises(ProtocolError):
        acceptor.on_auth(("out", b"x"), msg("auth", side.opening()), carries_session=False)
    with pytest.raises(ProtocolError):
        acceptor.on_auth(ROUTE, msg("auth", side.opening()), carries_session=True)


FIELDS = st.fixed_dictionaries(
    {
        "conn": st.sampled_from(["conn-1", "conn-2", ""]),
        "nonce": st.binary(max_size=80),
        "nonce_i": st.binary(max_size=80),
        "nonce_a": st.binary(max_size=80),
        "mac": st.binary(max_size=40),
    }
)


@given(st.lists(st.tuples(st.sampled_from(["auth", "proof"]), FIELDS), max_size=12))
def test_a_stranger_never_gets_admitted_and_only_protocol_errors_leave(messages: list[tuple[str, Any]]) -> None:
    """Whatever a party without the secret sends the acceptor, in whatever order, nothing is
    kept for it, and nothing but ProtocolError (or a refusal) comes back."""
    acceptor = Acceptor(SECRET, max_pending=2, cookie_ttl=10)
    for kind, fields in messages:
        try:
            if kind == "auth":
                acceptor.on_auth(ROUTE, msg(kind, fields), carries_session=False)
            else:
                assert acceptor.on_proof(ROUTE, msg(kind, fields)) is PROOF_FAILED
        except ProtocolError:
            pass
    assert not acceptor.pending


@given(FIELDS, FIELDS)
def test_the_initiator_takes_only_its_own_exchange(challenge: dict[str, Any], answer: dict[str, Any]) -> None:
    side = InitiatorExchange("conn-1")
    try:
        side.on_challenge(SECRET, msg("challenge", challenge))
    except ProtocolError:
        assert side.step == "auth"
        return
    try:
        outcome = side.on_proof(SECRET, msg("proof", answer))
    except ProtocolError:
        return
    assert outcome is PROOF_FAILED and side.step == "proof"
