"""The express stream (kvtransport/runtime/express.py, its port, and express_link.py, the stream
itself): "done" on a plain socket beside the control channel, bound to its session by a sealed
first frame, and what a stranger on its port gets.

The stranger here speaks raw TCP with bytes built by this file (the frame layout is read from
docs/security.md, not imported), so a mismatch between the two would show."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.runtime.auth import Seal
from kvtransport.runtime.config import Limits, express_from_env
from kvtransport.runtime.endpoint import Connection, Endpoint, State, Timeouts
from kvtransport.runtime.express_link import MAX_FRAME_BYTES, FrameReader
from kvtransport.runtime.wire import Done, encode
from kvtransport.spi.errors import ConfigError, KVTransportError, PeerLost, ProtocolError
from kvtransport.testing.fake import FakeDriver, FakeTwoSided
from kvtransport.tools.kv_pool import KVPool

pytestmark = pytest.mark.timeout(120)

FAKE = {"fake": FakeDriver}
FAST = Timeouts(connect=1.5, bootstrap=5, waiting=5, transfer=5, heartbeat_interval=0.1, heartbeat_timeout=2.0)
SECRET = b"test-express-deployment-secret-000001"


@contextlib.contextmanager
def endpoint(name: str, drivers: dict[str, type] | None = None, **kwargs: object) -> Iterator[tuple[Endpoint, KVPool]]:
    pool = KVPool(32, 2, 256, 2)
    pool.fill(len(name))
    ep = None
    try:
        ep = Endpoint(
            pool.regions,
            pool.layout,
            drivers=drivers or FAKE,
            name=name,
            timeouts=FAST,
            secret=SECRET,
            **kwargs,  # type: ignore[arg-type]
        )
        yield ep, pool
    finally:
        if ep is not None:
            ep.close()
        pool.close()


@contextlib.contextmanager
def connected(
    prefill_kwargs: dict[str, object] | None = None, decode_kwargs: dict[str, object] | None = None
) -> Iterator[tuple[Endpoint, KVPool, Connection, Endpoint, KVPool, Connection]]:
    with (
        endpoint("prefill", **(prefill_kwargs or {})) as (prefill, a_pool),
        endpoint("decode", **(decode_kwargs or {})) as (decode, b_pool),
    ):
        recv = decode.connect(prefill.address)
        send = prefill.accept(5)
        yield prefill, a_pool, send, decode, b_pool, recv


def move(recv: Connection, send: Connection, tag: str, src: list[int], dst: list[int], chunks: int = 1) -> None:
    r = recv.expect(tag, dst)
    t = send.sender(tag)
    until(lambda: t.state is not State.BOOTSTRAPPING, "the announcement")
    step = max(1, len(src) // chunks)
    for i in range(0, len(src), step):
        t.send(src[i : i + step], last=i + step >= len(src))
    assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS


def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def dial(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the endpoint closed ``s`` (EOF or reset) within ``timeout``."""
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def forged_seal(body: bytes, key: bytes = b"\x00" * 32, seq: int = 1) -> bytes:
    """``0xC1 | seq | HMAC(key, 0xC1 | seq | body) | body`` under a key that is not the session's."""
    header = struct.pack(">BQ", 0xC1, seq)
    return header + hmac.new(key, header + body, hashlib.sha256).digest() + body


# -- what carries "done" ---------------------------------------------------------------------


def test_a_one_batch_transfer_says_done_on_the_express_stream() -> None:
    with connected() as (prefill, a_pool, send, decode, b_pool, recv):
        until(lambda: send._session.express is not None and recv._session.express is not None, "both ends bound")
        link = send._session.express
        assert link is not None
        move(recv, send, "one", [1, 2], [3, 4])
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])
        assert link.sent == 1
        receiving = recv._session.express
        assert receiving is not None and receiving.received == 1
        move(recv, send, "chunked", [5, 6, 7, 8], [9, 10, 11, 12], chunks=2)
        assert b_pool.page_digests([9, 10, 11, 12]) == a_pool.page_digests([5, 6, 7, 8])
        assert link.sent == 1, "a transfer of several batches says done on the control channel"
        assert prefill.stats()["express_links"] == decode.stats()["express_links"] == 1


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_without_express_on_either_side_done_takes_the_control_channel(side: str) -> None:
    off = {"express": False}
    with connected(off if side == "prefill" else None, off if side == "decode" else None) as parts:
        prefill, a_pool, send, decode, b_pool, recv = parts
        move(recv, send, "one", [1, 2], [3, 4])
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])
        assert send._session.express is None and recv._session.express is None
        assert prefill.stats()["express_links"] == decode.stats()["express_links"] == 0


def test_the_setting_is_checked() -> None:
    assert express_from_env({}) is True
    assert express_from_env({"KVTRANSPORT_EXPRESS": "0"}) is False
    with pytest.raises(ConfigError, match="KVTRANSPORT_EXPRESS"):
        express_from_env({"KVTRANSPORT_EXPRESS": "maybe"})
    with pytest.raises(ConfigError, match="KVTRANSPORT_INLINE_WAIT_US"):
        Limits.from_env({"KVTRANSPORT_INLINE_WAIT_US": "-1"})
    assert Limits.from_env({"KVTRANSPORT_INLINE_WAIT_US": "0"}).inline_wait_us == 0


def test_a_broken_stream_is_closed_and_the_session_goes_on() -> None:
    """A frame that fails authentication on a bound stream (here written into the sender's own
    socket, as an attacker on the path would): the receiver closes the stream, both sides forget
    it, and the next transfers say done on the control channel, every byte right."""
    with connected() as (prefill, a_pool, send, decode, b_pool, recv):
        until(lambda: send._session.express is not None and recv._session.express is not None, "both ends bound")
        link = send._session.express
        assert link is not None
        link.sock.send(frame(forged_seal(b"\x80")))
        until(lambda: recv._session.express is None and send._session.express is None, "the stream closed")
        move(recv, send, "after", [1, 2], [3, 4])
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])
        assert recv.alive and send.alive
        assert prefill.stats()["express_links"] == decode.stats()["express_links"] == 0


# -- ordered mode (two-sided sessions) ---------------------------------------------------------

TWO_SIDED: dict[str, object] = {
    "drivers": {"fake-two-sided": FakeTwoSided},
    "driver_options": {"fake.inbound_delay": "0"},
}


def ordered_pair() -> contextlib.AbstractContextManager[
    tuple[Endpoint, KVPool, Connection, Endpoint, KVPool, Connection]
]:
    return connected(TWO_SIDED, TWO_SIDED)


def test_a_two_sided_session_sends_its_notices_and_done_on_the_stream_in_ordered_mode() -> None:
    """Bound before anything ordered went out: every driver notice and "done" of the sender's
    transfers go on the stream, none on the control channel; bytes verified."""
    with ordered_pair() as (_prefill, a_pool, send, _decode, b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        link = send._session.ordered
        receiving = recv._session.ordered
        assert link is not None and receiving is not None
        on_control = []
        real_send_frame = send._session.send_frame

        def spy(data: bytes) -> bool:
            on_control.append(data)
            return real_send_frame(data)

        send._session.send_frame = spy  # type: ignore[method-assign]
        sent, received = link.sent, receiving.received
        move(recv, send, "one", [1, 2], [3, 4])
        move(recv, send, "chunked", [5, 6, 7, 8], [9, 10, 11, 12], chunks=2)
        assert b_pool.page_digests([3, 4, 9, 10, 11, 12]) == a_pool.page_digests([1, 2, 5, 6, 7, 8])
        # A "done" a transfer (2), and one notice a batch (3), of which the one-batch
        # transfer's rides in its "done": 4 frames.
        assert link.sent - sent >= 4
        until(lambda: receiving.received - received >= 4, "the receiver reading them")
        kinds = {decode_kind(d) for d in on_control}
        assert not kinds & {"notice", "done"}, f"ordered messages went on the control channel: {kinds}"


def test_a_receiver_whose_driver_is_idle_decides_success_while_it_handles_done() -> None:
    """The driver copied everything in as the notices came (idle at "done"): the transfer is a
    Success by the time its "done" has been handled, in the same pass of the I/O thread, with no
    round trip through the driver's thread and the I/O thread's queue; and the chunk notice
    before it posted nothing to that queue either."""
    with ordered_pair() as (_prefill, a_pool, send, decode, b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        session = recv._session
        after_done: list[State] = []
        queued_in_handlers: list[str] = []
        handling: list[str] = []
        real_on_done, real_on_notice, real_call_soon = session.on_done, session.on_notice, decode.channel.call_soon

        def on_done(msg: Any) -> None:
            handling.append("done")
            try:
                real_on_done(msg)
            finally:
                handling.pop()
            after_done.append(session.transfers[msg["tag"]].state)

        def on_notice(msg: Any) -> None:
            handling.append("notice")
            try:
                real_on_notice(msg)
            finally:
                handling.pop()

        def call_soon(fn: Callable[[], None], timeout: float = 10.0) -> None:
            if handling and decode.channel.in_io_thread():
                queued_in_handlers.append(handling[-1])
            real_call_soon(fn, timeout)

        session.on_done = on_done  # type: ignore[method-assign]
        session.on_notice = on_notice  # type: ignore[method-assign]
        decode.channel.call_soon = call_soon  # type: ignore[method-assign]
        for i in range(5):
            move(recv, send, f"idle-{i}", [1, 2], [3, 4])
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])
        assert after_done == [State.SUCCESS] * 5
        assert queued_in_handlers == []


def test_a_frame_that_arrives_while_the_last_is_handled_is_read_in_the_same_pass() -> None:
    """A chunk's notice is followed by "done" while the receiver still handles the notice: the
    stream is read again before the loop goes back to its poll, so the second frame is handled
    in the same pass of the I/O thread."""
    with ordered_pair() as (_prefill, _a_pool, send, decode, _b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        session = recv._session
        handled: list[tuple[bytes, int]] = []
        real_on_notice = session.on_notice
        lane = send._session.wire_name(send._session.primary.name if send._session.primary else "")

        def on_notice(msg: Any) -> None:
            handled.append((msg["payload"], decode.channel.passes))
            if msg["payload"] == b"first":
                # The peer writes its next frame now, while this one is being handled.
                assert send._session.order.send(encode("notice", payload=b"second", lane=lane))
                time.sleep(0.05)  # it is in this side's socket by the time this handler returns
            real_on_notice(msg)

        session.on_notice = on_notice  # type: ignore[method-assign]
        assert send._session.order.send(encode("notice", payload=b"first", lane=lane))
        until(lambda: len(handled) == 2, "both notices handled")
        (first, pass_1), (second, pass_2) = handled
        assert (first, second) == (b"first", b"second")
        assert pass_1 == pass_2, "the second frame waited for another loop pass"


class _FailingNotices(FakeTwoSided):
    """Refuses any notice that starts with b"bad" (a malformed staging notice, say)."""

    capabilities = FakeTwoSided.capabilities

    def on_notice(self, peer: str, payload: bytes) -> None:
        if payload.startswith(b"bad"):
            raise ProtocolError("a malformed notice")
        super().on_notice(peer, payload)


def test_a_notice_that_failed_on_the_drivers_thread_is_never_followed_by_success() -> None:
    """A large notice runs on the driver's thread; its failure ends the session through the I/O
    thread's queue. A "done" handled after the driver went idle again, but before that queued
    end ran, must not find the driver idle and answer Success for a chunk never written."""
    receiver = {"drivers": {"fake-two-sided": _FailingNotices}, "driver_options": {"fake.inbound_delay": "0"}}
    with connected(TWO_SIDED, receiver) as (_prefill, _a_pool, send, _decode, _b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        session = recv._session
        lane_name = session.primary.name if session.primary else ""
        runner = session.lanes[lane_name].runner
        r = recv.expect("x", [3, 4])
        until(lambda: r.announced is not None, "the announcement filed")
        real_on_done = session.on_done

        def on_done(msg: Any) -> None:
            # Hold "done" until the driver's thread has finished the failed notice and gone idle.
            until(lambda: not runner._busy and not runner._calls and session.drivers.notice_failed, "the notice failed")
            real_on_done(msg)

        session.on_done = on_done  # type: ignore[method-assign]
        lane = send._session.wire_name(lane_name)
        big = b"bad" + bytes(16 << 10)  # over the inline limit: it goes to the driver's thread
        assert send._session.order.send(encode("notice", payload=big, lane=lane))
        done = encode("done", tag="x", bytes=session.expected_bytes(r), lane=lane, notices=[])
        assert send._session.order.send(done)
        with pytest.raises(KVTransportError):
            r.wait(5)
        assert r.state is State.FAILED


def test_the_second_copy_of_a_bye_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """In ordered mode a closing peer sends "bye" on both channels; whichever arrives second
    finds the session gone. That is expected, not a stranger: no warning for it."""
    with ordered_pair() as (prefill, _a_pool, send, decode, _b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        with caplog.at_level(logging.WARNING, logger="kvtransport"):
            decode.close()
            until(lambda: not send.alive, "the bye handled")
            time.sleep(0.2)  # the other copy arrives meanwhile
        strangers = [r.getMessage() for r in caplog.records if "has not authenticated" in r.getMessage()]
        assert strangers == []
        assert prefill.stats()["sessions"] == 0


def test_the_routes_remembered_after_their_sessions_ended_are_bounded_and_expire() -> None:
    from kvtransport.runtime.endpoint import MAX_ENDED_ROUTES

    with endpoint("ended") as (ep, _pool):
        ep.timeouts = dataclasses.replace(FAST, heartbeat_timeout=0.2)
        for i in range(MAX_ENDED_ROUTES + 100):
            ep._remember_ended(("in", i.to_bytes(4, "big")))
        assert len(ep._ended_routes) == MAX_ENDED_ROUTES
        assert not ep._ended_lately(("in", (0).to_bytes(4, "big")))  # the oldest went first
        assert ep._ended_lately(("in", (MAX_ENDED_ROUTES + 99).to_bytes(4, "big")))
        time.sleep(0.3)
        assert not ep._ended_lately(("in", (MAX_ENDED_ROUTES + 99).to_bytes(4, "big")))
        ep._remember_ended(("in", b"last"))
        assert list(ep._ended_routes) == [("in", b"last")]  # the expired ones are gone


def decode_kind(data: bytes) -> str:
    """The message type of an encoded message the session handed its control channel."""
    from kvtransport.runtime.wire import decode

    return decode(data).type


def test_a_broken_stream_in_ordered_mode_ends_the_session_with_peer_lost() -> None:
    """Messages may have been lost with the stream and none may take another way: a transfer
    waiting on the session fails with PeerLost (no hang), and the endpoints go on serving."""
    with ordered_pair() as (prefill, a_pool, send, decode, b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        r = recv.expect("cut", [3, 4])
        link = send._session.ordered
        assert link is not None
        link.sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(PeerLost):
            r.wait(5)
        assert r.state is State.FAILED
        again = decode.connect(prefill.address)
        conn = prefill.accept(5)
        move(again, conn, "after", [1, 2], [5, 6])
        assert b_pool.page_digests([5, 6]) == a_pool.page_digests([1, 2])


def test_a_session_that_sent_ordered_messages_on_control_does_not_switch() -> None:
    """Without a stream at the peer, the receiver's "expect" goes on the control channel; a
    stream offered after that must not take ordered mode (it could overtake what was sent)."""
    with ordered_pair() as (_prefill, _a_pool, _send, _decode, _b_pool, recv):
        until(lambda: recv._session.express is not None, "the stream bound")
        session = recv._session
        with session.order.lock:
            was = session.ordered
        if was is None:
            pytest.fail("a fresh two-sided session should have taken ordered mode")
        # A session that already sent an ordered message on control refuses the switch.
        session.order.link = None
        session.order.sent_on_control = True
        assert session.take_ordered_mode(was) is False
        assert session.ordered is None
        session.order.sent_on_control = False
        assert session.take_ordered_mode(was) is True


def test_frames_after_binding_may_be_large_but_not_before() -> None:
    reader = FrameReader()
    assert reader.limit == MAX_FRAME_BYTES
    with pytest.raises(ProtocolError):
        reader.feed(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x")
    bound = FrameReader()
    bound.limit = 1 << 20
    big = b"y" * (MAX_FRAME_BYTES * 8)
    assert bound.feed(frame(big)) == [big]
    # Before binding only the first frame is cut: what follows waits for the bound limit.
    first = FrameReader()
    assert first.feed(frame(b"bind") + frame(big), most=1) == [b"bind"]
    first.limit = 1 << 20
    assert first.feed(b"") == [big]


# -- strangers on the express port -------------------------------------------------------------

HOSTILE: dict[str, Callable[[str], bytes]] = {
    "random-bytes": lambda conn: os.urandom(512),
    "oversized-length": lambda conn: struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 64,
    "huge-length": lambda conn: struct.pack(">I", 0xFFFFFFFF),
    "zero-length": lambda conn: struct.pack(">I", 0),
    "no-connection-id": lambda conn: frame(b"just some bytes"),
    "unknown-connection": lambda conn: frame(b"0" * 32 + b"\n" + forged_seal(b"\x80")),
    "non-ascii-id": lambda conn: frame("é".encode() * 8 + b"\n" + forged_seal(b"\x80")),
    # The live session's id with a seal under another key: only its keys can bind.
    "forged-binding": lambda conn: frame(conn.encode() + b"\n" + forged_seal(b"\x80")),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_stranger_on_the_express_port_is_closed_and_binds_nothing(attack: str) -> None:
    with connected() as (prefill, _, send, _, b_pool, recv):
        assert prefill.express is not None
        until(lambda: send._session.express is not None, "the session's own stream")
        link = send._session.express
        before = b_pool.page_digests(list(range(32)))
        s = dial(prefill.express.port)
        try:
            s.sendall(HOSTILE[attack](send.id))
            assert closed_by_peer(s), "the endpoint should close a stream that does not bind"
        finally:
            s.close()
        until(lambda: prefill.stats()["express_unbound"] == 0, "the stranger forgotten")
        assert send._session.express is link, "a stranger must not replace the session's stream"
        assert b_pool.page_digests(list(range(32))) == before
        move(recv, send, "after", [1, 2], [3, 4])
        assert link is not None and link.sent == 1


@pytest.mark.parametrize("seal", ["forged", "replayed-control-channel-key"])
def test_only_the_sessions_keys_bind_a_stream_it_is_waiting_for(seal: str) -> None:
    """The initiator runs without express, so the acceptor's session waits for a stream that
    never comes: a stranger presenting that session's id with a seal under another key (a
    made-up one, or the session's control-channel key, which a frame of the control channel
    would carry) is closed, and the session keeps no stream."""
    with connected(decode_kwargs={"express": False}) as (prefill, a_pool, send, decode, b_pool, recv):
        assert prefill.express is not None and send._session.express is None
        assert send._session.express_seal is not None
        if seal == "forged":
            sealed = forged_seal(b"\x82\xa1v\x06\xa1t\xa7express")
        else:
            # A frame of this session, sealed for the control channel (initiator's direction).
            peer = recv._session
            other = Seal(decode.secret, peer.id, peer.exchange.nonce_i, peer.exchange.nonce_a, initiator=True)
            sealed = other.seal(b"x")
        s = dial(prefill.express.port)
        try:
            s.sendall(frame(send.id.encode() + b"\n" + sealed))
            assert closed_by_peer(s)
        finally:
            s.close()
        assert send._session.express is None and prefill.stats()["express_links"] == 0
        move(recv, send, "after", [1, 2], [3, 4])
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])


def test_silent_strangers_are_capped_and_expire() -> None:
    with connected({"limits": Limits(max_pending_handshakes=4)}) as (prefill, _, send, _, _, recv):
        assert prefill.express is not None
        socks = [dial(prefill.express.port) for _ in range(10)]
        try:
            until(lambda: sum(1 for s in socks if s.fileno() >= 0) == 10, "the dials")
            time.sleep(0.3)
            assert prefill.stats()["express_unbound"] <= 4
            # The connect timeout (1.5 s here) closes those that never bound.
            until(lambda: prefill.stats()["express_unbound"] == 0, "silent strangers expired", timeout=5)
            assert all(closed_by_peer(s, 1) for s in socks[-4:])
        finally:
            for s in socks:
                s.close()
        move(recv, send, "after", [1, 2], [3, 4])


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=10),
)
def test_the_frame_reader_gives_back_each_frame_however_the_stream_is_cut(frames: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(f) for f in frames)
    points = sorted({0, len(stream), *(c for c in cuts if c <= len(stream))})
    reader, out = FrameReader(), []
    for lo, hi in itertools.pairwise(points):
        out += reader.feed(stream[lo:hi])
    assert out == frames and reader.pending == 0


@given(n=st.one_of(st.just(0), st.integers(min_value=MAX_FRAME_BYTES + 1, max_value=2**32 - 1)))
def test_the_frame_reader_refuses_empty_and_oversized_frames(n: int) -> None:
    with pytest.raises(ProtocolError, match="express frame"):
        FrameReader().feed(struct.pack(">I", n) + b"x")


def _stream_garbage(conn: str) -> st.SearchStrategy[bytes]:
    """What a stranger might write: raw bytes, frames of random bodies, frames shaped like a
    binding (a real or random id, a newline, a seal-like body), several of them back to back."""
    ids = st.one_of(st.just(conn.encode()), st.binary(max_size=80))
    sealed = st.one_of(
        st.binary(max_size=200),
        st.builds(lambda body, seq: forged_seal(body, seq=seq), st.binary(max_size=120), st.integers(0, 2**64 - 1)),
    )
    binding = st.builds(lambda i, s: frame(i + b"\n" + s), ids, sealed)
    lengths = st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">I", n))
    piece = st.one_of(st.binary(max_size=300), st.builds(frame, st.binary(min_size=1, max_size=300)), binding, lengths)
    return st.lists(piece, min_size=1, max_size=4).map(b"".join)


def test_generated_garbage_on_the_express_port_binds_nothing_and_stops_nothing() -> None:
    """Hypothesis writes generated streams to fresh connections of a live endpoint's express
    port; after each: no stranger is left bound or waiting once it hung up, the session's own
    stream is the same object, and after all of them a transfer still says done express, byte
    for byte, with no page of the receiver changed by the strangers."""
    with connected() as (prefill, a_pool, send, _, b_pool, recv):
        assert prefill.express is not None
        port = prefill.express.port
        until(lambda: send._session.express is not None, "the session's own stream")
        link = send._session.express
        before = b_pool.page_digests(list(range(32)))

        @settings(max_examples=400, deadline=None, database=None)
        @given(data=st.data())
        def attack(data: st.DataObject) -> None:
            payload = data.draw(_stream_garbage(send.id))
            s = dial(port)
            try:
                with contextlib.suppress(OSError):
                    s.sendall(payload)
            finally:
                s.close()
            assert send._session.express is link

        attack()
        until(lambda: prefill.stats()["express_unbound"] == 0, "every stranger forgotten")
        assert b_pool.page_digests(list(range(32))) == before
        move(recv, send, "after", [1, 2], [3, 4])
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])
        assert link is not None and link.sent == 1 and send._session.express is link
        assert prefill.stats()["express_links"] == 1


# -- a one-batch transfer's notices ride in its "done" ------------------------------------------


def _handled(session: Any) -> list[tuple[str, int]]:
    """Spy on what ``session`` handles: ("notice", 0) per notice message, ("done", n) per
    "done" carrying n notices."""
    seen: list[tuple[str, int]] = []
    real_on_done, real_on_notice = session.on_done, session.on_notice

    def on_done(msg: Any) -> None:
        seen.append(("done", len(msg["notices"])))
        real_on_done(msg)

    def on_notice(msg: Any) -> None:
        seen.append(("notice", 0))
        real_on_notice(msg)

    session.on_done = on_done
    session.on_notice = on_notice
    return seen


def test_the_notice_of_a_batch_that_finishes_inside_submit_rides_in_its_done() -> None:
    """A one-batch transfer whose batch finished on the submitting thread: its chunk notice
    goes out inside its "done" (one frame, one message for the peer to open and decode), is
    handled by the receiver's driver before the "done", and the bytes are right. A transfer of
    several chunks sends its notices as messages of their own, as before."""
    with ordered_pair() as (_prefill, a_pool, send, decode, b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        link = send._session.ordered
        assert link is not None
        seen = _handled(recv._session)
        driver = decode.drivers["fake-two-sided"]
        assert isinstance(driver, FakeTwoSided)
        notices_before, sent = len(driver.notices), link.sent
        move(recv, send, "one", [1, 2], [3, 4])
        assert link.sent - sent == 1, "the notice and the done went as more than one frame"
        until(lambda: len(seen) == 1, "the done handled")
        assert seen == [("done", 1)]
        assert len(driver.notices) == notices_before + 1  # handed to the driver like any notice
        seen.clear()
        move(recv, send, "chunked", [5, 6, 7, 8], [9, 10, 11, 12], chunks=2)
        until(lambda: len(seen) == 3, "two notices and the done handled")
        assert seen == [("notice", 0), ("notice", 0), ("done", 0)]
        assert b_pool.page_digests([3, 4, 9, 10, 11, 12]) == a_pool.page_digests([1, 2, 5, 6, 7, 8])


def test_a_done_whose_notice_is_refused_ends_the_session_and_never_succeeds() -> None:
    """A notice that rides in a "done" is checked as one sent on its own: a malformed one
    ends the session, and the "done" it came in does not make the transfer a Success."""
    receiver = {"drivers": {"fake-two-sided": _FailingNotices}, "driver_options": {"fake.inbound_delay": "0"}}
    with connected(TWO_SIDED, receiver) as (_prefill, _a_pool, send, _decode, _b_pool, recv):
        until(lambda: send._session.ordered is not None and recv._session.ordered is not None, "ordered mode")
        session = recv._session
        r = recv.expect("x", [3, 4])
        until(lambda: r.announced is not None, "the announcement filed")
        lane = send._session.wire_name(session.primary.name if session.primary else "")
        done = encode("done", tag="x", bytes=session.expected_bytes(r), lane=lane, notices=[b"bad notice"])
        assert send._session.order.send(done)
        with pytest.raises(KVTransportError):
            r.wait(5)
        assert r.state is State.FAILED
        until(lambda: recv._session.phase.name == "CLOSED", "the session ended")


_LANES = st.sampled_from(["", "fake-two-sided", "other"])
_ITEMS = st.lists(
    st.one_of(
        st.tuples(_LANES, st.binary(max_size=64)),  # a driver notice for a lane
        st.tuples(st.none(), st.sampled_from(["abort", "drained"])),  # another ordered message
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(items=_ITEMS, with_done=st.booleans(), big=st.booleans())
def test_released_messages_reach_the_peer_in_the_order_they_were_held(
    items: list[tuple[str | None, Any]], with_done: bool, big: bool
) -> None:
    """Whatever a thread held (notices of any lane, other messages, many or large ones), what it
    releases decodes, in the order the receiver handles it (a "done"'s notices just before the
    "done"), to exactly what was held, then the "done"; the notices ride in the "done" only when
    they are all its lane's, at most MAX_DONE_NOTICES, and fit in one message."""
    from kvtransport.runtime.ordered import OrderedStream
    from kvtransport.runtime.wire import MAX_DONE_NOTICES, decode, max_message_bytes

    # Only the holding and its writes are exercised: the owner is just what OrderedStream reads.
    owner = SimpleNamespace(id="peer", closing=False, two_sided=True, max_message_bytes=max_message_bytes())
    stream = OrderedStream(owner)  # type: ignore[arg-type]
    frames: list[bytes] = []
    stream._write = lambda fs: frames.extend(fs) or True  # type: ignore[method-assign]
    filler = bytes(max_message_bytes() // 2) if big else b""
    expected: list[tuple[str, str, bytes]] = []
    stream.hold()
    for lane, what in items:
        if lane is None:
            assert stream.send(encode(what, tag="t", reason="r") if what == "abort" else encode(what, tag="t"))
            expected.append((what, "", b""))
        else:
            payload = what + filler
            assert stream.hold_notice(lane, payload)
            expected.append(("notice", lane, payload))
    done = Done("t", 1, "fake-two-sided") if with_done else None
    assert stream.release(done)
    if done is not None:
        expected.append(("done", "fake-two-sided", b""))
    got: list[tuple[str, str, bytes]] = []
    riding = 0
    for data in frames:
        msg = decode(data)
        if msg.type == "done":
            got += [("notice", msg["lane"], p) for p in msg["notices"]]
            riding += len(msg["notices"])
            got.append(("done", msg["lane"], b""))
        elif msg.type == "notice":
            got.append(("notice", msg["lane"], msg["payload"]))
        else:
            got.append((msg.type, "", b""))
    assert got == expected
    notices = [lane for lane, _ in items]
    fits = len(items) * len(filler) < max_message_bytes() - 4096
    if with_done and items and len(items) <= MAX_DONE_NOTICES and set(notices) == {"fake-two-sided"} and fits:
        assert len(frames) == 1 and riding == len(items)
    else:
        assert riding == 0
    # Released: nothing is held any more, a later message goes out at once.
    assert not stream.hold_notice("", b"x")


def test_a_peer_that_reads_nothing_costs_only_its_own_session() -> None:
    """An ordered session whose peer stops reading (a long pause, SIGSTOP, a member that
    never reads its stream) while this side has messages for it: what does not fit waits in
    the stream's backlog, and no thread waits for room. A writer that waited held the I/O
    thread (shared by every peer) for the heartbeat timeout, and a third, healthy peer then
    declared this endpoint lost. Now the healthy peer stays, and the silent one's session ends
    with ``PeerLost`` once it has read nothing for the heartbeat timeout."""
    two_sided = {"fake-two-sided": FakeTwoSided}
    timeouts = Timeouts(connect=5, bootstrap=30, waiting=30, transfer=30, heartbeat_interval=0.1, heartbeat_timeout=1.0)
    pages = 1 << 18
    pools = [KVPool(pages, 1, 16, 4) for _ in range(3)]
    decode, silent, healthy = (
        Endpoint(p.regions, p.layout, drivers=two_sided, name=n, timeouts=timeouts)
        for p, n in zip(pools, ("decode", "silent", "healthy"), strict=True)
    )
    try:
        to_silent = decode.connect(silent.address)
        silent.accept(5)
        decode.connect(healthy.address)
        from_decode = healthy.accept(5)
        deadline = time.monotonic() + 5
        while to_silent._session.ordered is None:
            assert time.monotonic() < deadline, "the session to the silent peer never took ordered mode"
            time.sleep(0.01)
        silent.call(lambda: time.sleep(4))  # its I/O thread, the stream's only reader, stops
        everything = list(range(pages))
        for i in range(6):  # 2 MiB announcements each: far more than the socket buffers hold
            to_silent.expect(f"r{i}", everything)
        # The I/O thread, which sends them, still answers at once (it waited for room before).
        time.sleep(0.2)
        for _ in range(5):
            answered = threading.Event()
            started = time.monotonic()
            decode.call(answered.set)
            assert answered.wait(5)
            took = time.monotonic() - started
            assert took < 0.3, f"the I/O thread took {took:.2f} s to run a queued call"
        time.sleep(3.0)
        assert from_decode.alive, f"the healthy peer lost this endpoint: {from_decode.error}"
        assert not to_silent.alive and isinstance(to_silent.error, PeerLost), to_silent.error
    finally:
        for ep in (decode, silent, healthy):
            ep.close()
        for p in pools:
            p.close()
