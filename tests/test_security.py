"""The authenticated control plane (docs/security.md), endpoints in one process on the fake
driver: where the secret comes from and who may listen where; endpoints with a wrong or no
secret; what a refused party learns; replays of a legitimate session's frames into a new
connection and into the live session; connection ids and tags bound to their session.

The raw side (sockets that are not kvtransport endpoints) speaks the wire as
``tests/hostile_messages.py`` writes it from the spec, not through kvtransport's own code. The
same attacks from another process, on nixl-ucx too, are in ``tests/test_hostile.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.negotiation.hello import PROTOCOL_VERSION
from kvtransport.runtime import auth
from kvtransport.runtime.auth import load_secret
from kvtransport.runtime.endpoint import Connection, Endpoint, State, Timeouts
from kvtransport.spi.errors import AuthenticationFailed, ConfigError, KVTransportError, TransferAborted
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import KVPool
from tests.hostile_messages import (
    RecordingProxy,
    authenticate,
    derive,
    master_key,
    message,
    well_formed,
)

FAKE = {"fake": FakeDriver}
FAST = Timeouts(connect=5, bootstrap=5, waiting=5, transfer=5, heartbeat_interval=0.1, heartbeat_timeout=2.0)
SECRET = b"test-security-deployment-secret-0001"
OTHER = b"test-security-another-secret-0000002"


@contextlib.contextmanager
def endpoint(name: str, secret: bytes | None = SECRET, **kwargs: object) -> Iterator[tuple[Endpoint, KVPool]]:
    pool = KVPool(32, 2, 256, 2)
    pool.fill(len(name))
    ep = None
    try:
        ep = Endpoint(pool.regions, pool.layout, drivers=FAKE, name=name, timeouts=FAST, secret=secret, **kwargs)  # type: ignore[arg-type]
        yield ep, pool
    finally:
        if ep is not None:
            ep.close()
        pool.close()


def move(recv: Connection, send: Connection, tag: str, src: list[int], dst: list[int]) -> None:
    r = recv.expect(tag, dst)
    t = send.sender(tag)
    deadline = time.monotonic() + 5
    while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
        time.sleep(0.001)
    t.send(src, last=True)
    assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS


def raw_socket(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def received(sock: zmq.Socket[bytes], wait: float = 0.3) -> list[bytes]:
    out = []
    while sock.poll(int(wait * 1000)):
        out.append(sock.recv())
    return out


# -- the secret and where an endpoint may listen ---------------------------------------------


def test_the_secret_comes_from_the_environment_or_an_owner_only_file(tmp_path: Path) -> None:
    assert load_secret(env={}).authenticated is False
    env_secret = load_secret(env={"KVTRANSPORT_SECRET": SECRET.decode()})
    assert env_secret.authenticated and env_secret.source == "KVTRANSPORT_SECRET"
    assert SECRET.decode() not in repr(env_secret) and env_secret.key not in repr(env_secret).encode()
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by others.*chmod 600"):
        load_secret(env={"KVTRANSPORT_SECRET_FILE": str(path)})
    path.chmod(0o640)  # group read: a Kubernetes fsGroup
    assert load_secret(env={"KVTRANSPORT_SECRET_FILE": str(path)}).authenticated
    path.chmod(0o660)
    with pytest.raises(ConfigError, match="writable by its group"):
        load_secret(env={"KVTRANSPORT_SECRET_FILE": str(path)})
    path.chmod(0o600)
    link = tmp_path / "mounted"  # Kubernetes mounts each key of a Secret as a symbolic link
    link.symlink_to(path)
    assert load_secret(env={"KVTRANSPORT_SECRET_FILE": str(link)}).key == env_secret.key
    from_file = load_secret(env={"KVTRANSPORT_SECRET_FILE": str(path)})
    assert from_file.key == env_secret.key, "a trailing newline in the file must not change the secret"
    with pytest.raises(ConfigError, match="both"):
        load_secret(env={"KVTRANSPORT_SECRET": SECRET.decode(), "KVTRANSPORT_SECRET_FILE": str(path)})
    with pytest.raises(ConfigError, match="at least 32"):
        load_secret(env={"KVTRANSPORT_SECRET": "0123456789abcdef"})  # token_hex(8): 64 bits
    with pytest.raises(ConfigError, match="cannot open"):
        load_secret(env={"KVTRANSPORT_SECRET_FILE": str(tmp_path / "missing")})


def test_an_endpoint_reachable_from_other_hosts_needs_a_secret_or_an_explicit_opt_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError, match=r"KVTRANSPORT_SECRET.*KVTRANSPORT_INSECURE=1"):
        with endpoint("open", secret=None, listen="tcp://0.0.0.0:0"):
            pass
    with endpoint("secured", listen="tcp://0.0.0.0:0") as (ep, _):
        assert ep.security.startswith("authenticated")
    with endpoint("local", secret=None) as (ep, _):
        assert ep.security.startswith("not authenticated") and "loopback" in ep.security
    monkeypatch.setenv("KVTRANSPORT_INSECURE", "1")
    import kvtransport.runtime.endpoint as endpoint_module

    monkeypatch.setattr(endpoint_module, "_insecure_warned", False)
    with caplog.at_level(logging.WARNING, logger="kvtransport"):
        for i in range(3):
            with endpoint(f"trusted-{i}", secret=None, listen="tcp://0.0.0.0:0") as (ep, _):
                assert ep.security.startswith("NOT AUTHENTICATED")
    assert sum("NOT AUTHENTICATED" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv("KVTRANSPORT_INSECURE", "yes")
    with pytest.raises(ConfigError, match="KVTRANSPORT_INSECURE='yes'"):
        with endpoint("typo", secret=None, listen="tcp://0.0.0.0:0"):
            pass


def test_doctor_says_whether_the_control_plane_is_authenticated() -> None:
    def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTRANSPORT_")}
        return subprocess.run(
            [sys.executable, "-m", "kvtransport.tools.cli", "doctor", *args],
            capture_output=True,
            text=True,
            env={**clean, **env},
            timeout=120,
        )

    out = doctor("--listen", "tcp://0.0.0.0:7000", KVTRANSPORT_SECRET=SECRET.decode())
    assert "control: authenticated: deployment secret from KVTRANSPORT_SECRET" in out.stdout
    refused = doctor("--listen", "tcp://0.0.0.0:7000")
    assert refused.returncode == 1
    assert "would refuse to start" in refused.stdout and "KVTRANSPORT_INSECURE=1" in refused.stdout
    assert "loopback only" in doctor().stdout


# -- peers without the secret -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("initiator", "acceptor"), [(OTHER, SECRET), (None, SECRET), (SECRET, None)], ids=["wrong", "none", "acceptor-none"]
)
def test_an_endpoint_without_the_deployments_secret_is_refused(
    initiator: bytes | None, acceptor: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        endpoint("prefill", acceptor) as (prefill, a_pool),
        endpoint("decode", acceptor) as (decode, b_pool),
        endpoint("stranger", initiator) as (stranger, _),
    ):
        recv = decode.connect(prefill.address)
        send = prefill.accept(5)
        with caplog.at_level(logging.WARNING, logger="kvtransport"):
            with pytest.raises(AuthenticationFailed, match="authentication failed"):
                stranger.connect(prefill.address, timeout=5)
            with pytest.raises(AuthenticationFailed, match="authentication failed"):
                stranger.connect(prefill.address, timeout=5)
        assert len(prefill.connections) == 1 and prefill.stats()["pending_auth"] == 0
        # The acceptor says so: counted (by the address the transport saw, not by anything the
        # stranger said), and one warning for the window, not one per attempt.
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        failing = [m for m in warnings if "failing authentication" in m]
        assert len(failing) == 1, warnings
        assert "does not verify under this endpoint's secret" in failing[0] and "from 127.0.0.1" in failing[0]
        assert prefill.stats()["auth_failures_recent"] == 2 and decode.stats()["auth_failures_recent"] == 0
        snap = prefill.metrics.snapshot()["auth"]
        assert snap["failures"] == snap["recent"] == 2 and snap["last_from"] == "127.0.0.1"
        assert snap["last_at"] is not None and abs(snap["last_at"] - time.time()) < 60
        assert decode.metrics.snapshot()["auth"]["failures"] == 0
        move(recv, send, "after", [1, 2], [3, 4])
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])
        assert prefill.stats()["auth_failures_recent"] == 2  # a member's transfer is no failure


def test_failed_authentications_are_counted_in_bounded_memory_and_by_time() -> None:
    """The acceptor's record of failed authentications: a flood of them holds at most
    ``MAX_ENTRIES`` entries and still counts every one; a request is associated only with the
    failures within its grace of its arrival; one warning per window."""
    from kvtransport.runtime.auth_failures import MAX_ENTRIES, AuthFailures

    failures = AuthFailures("prefill", "the secret argument", keep=80.0)
    for i in range(20_000):  # 20,000 in 50 s
        failures.record(f"10.0.0.{i % 250}", now=1000.0 + i * 0.0025)
    assert len(failures._entries) <= MAX_ENTRIES
    assert failures.total == 20_000 and failures.recent(now=1050.0) == 20_000
    assert failures.recent(now=1100.0) < 20_000  # the window moved on
    snap = failures.snapshot(now=1050.0)
    assert snap["last_from"] == "10.0.0.249" and snap["window_s"] == 60.0
    assert failures.seen_around(1059.0, 10.0, now=1069.0)  # failed 9 s before it arrived
    assert not failures.seen_around(1061.0, 10.0, now=1071.0)  # more than its grace before
    quiet = AuthFailures("prefill", "the secret argument")
    quiet.record("10.0.0.1", now=500.0)
    assert quiet.seen_around(495.0, 10.0, now=505.0) and not quiet.seen_around(489.0, 10.0, now=505.0)
    assert "1 in the last 60 s, last from 10.0.0.1" in quiet.describe_recent(now=505.0)
    assert failures.describe_recent(now=1050.0).startswith("20000 in the last 60 s")
    # The longest keep an endpoint asks for (SGLang's 300 s bootstrap timeout as the grace):
    # entries merge failures up to 1.1 s apart, so the window's count is right within that.
    long = AuthFailures("prefill", "x", keep=660.0)
    for i in range(2_000):
        long.record("a", now=float(i))
    assert len(long._entries) <= MAX_ENTRIES and 59 <= long.recent(now=1_999.0) <= 61


def test_the_prometheus_collector_counts_failed_authentications() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from kvtransport.runtime.prometheus import register

    with endpoint("prefill") as (prefill, _), endpoint("stranger", OTHER) as (stranger, _):
        registry = prometheus_client.CollectorRegistry()
        register(prefill, registry=registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert "kvtransport_auth_failure_last_timestamp_seconds{" not in text  # none yet
        with pytest.raises(AuthenticationFailed):
            stranger.connect(prefill.address, timeout=5)
        text = prometheus_client.generate_latest(registry).decode()
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    total = samples["kvtransport_auth_failures_total"]
    assert total.value == 1 and total.labels == {"endpoint": "prefill"}  # no address label
    assert abs(samples["kvtransport_auth_failure_last_timestamp_seconds"].value - time.time()) < 60


def test_a_stranger_learns_a_nonce_and_authentication_failed_nothing_else() -> None:
    with endpoint("prefill") as (prefill, _):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = raw_socket(ctx, prefill.address)
            conn = uuid.uuid4().hex
            nonce_i = os.urandom(32)
            sock.send(message("auth", conn=conn, nonce=nonce_i))
            (challenge,) = received(sock, 2)
            obj = msgpack.unpackb(challenge)
            assert set(obj) == {"v", "t", "conn", "nonce"} and obj["t"] == "challenge" and obj["conn"] == conn
            assert len(obj["nonce"]) == 32 and obj["nonce"] != nonce_i
            # The wrong key: refused with three words. Then everything else a stranger can send.
            mac = derive(master_key(OTHER), b"proof initiator", conn.encode(), nonce_i, obj["nonce"])
            sock.send(message("proof", conn=conn, nonce_i=nonce_i, nonce_a=obj["nonce"], mac=mac))
            hello = message("hello", conn="c", hello={}, regions={}, lanes={})
            for frame in (
                hello,
                message("expect", tag="t", pages=b"\0" * 8, aux=-1, prefix=0, state=[]),
                message("ping", seq=1),
            ):
                sock.send(frame)
            got = received(sock, 1)
            refusal = {"v": PROTOCOL_VERSION, "t": "refuse", "reason": "authentication failed"}
            assert [msgpack.unpackb(f) for f in got] == [{**refusal, "conn": conn}, {**refusal, "conn": "c"}]
            assert prefill.stats()["sessions"] == 0 and prefill.stats()["pending_auth"] == 0
        finally:
            ctx.destroy(0)


# -- replays ------------------------------------------------------------------------------------


def test_replayed_frames_are_refused_in_a_new_connection_and_in_the_live_session() -> None:
    """A transfer through a recording proxy; then every frame the initiator sent, replayed
    exactly: on a new socket (it gets at most a fresh challenge and "authentication failed"),
    and injected into the live session (dropped: each was sealed for a sequence number already
    seen). Nothing changes; the session goes on."""
    with endpoint("prefill") as (prefill, a_pool), endpoint("decode") as (decode, b_pool):
        proxy = RecordingProxy(prefill.address)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            recv = decode.connect(proxy.address)
            send = prefill.accept(5)
            move(recv, send, "first", [1, 2], [3, 4])
            up = [f for d, f in proxy.sealed if d == "up"]
            assert sum(f[:1] == b"\xc1" for f in up) >= 2, "the session's frames should be sealed"
            session = send._session
            assert session.seal is not None
            before_pages = b_pool.page_digests(list(range(32)))
            # 1. into a new connection
            sock = raw_socket(ctx, prefill.address)
            for f in up:
                sock.send(f)
            for f in received(sock, 1):
                obj = well_formed(f)
                assert obj is not None and obj["t"] in ("challenge", "refuse"), f[:80]
                if obj["t"] == "refuse":
                    assert obj["reason"] == "authentication failed"
            assert len(prefill.connections) == 1
            # 2. into the live session
            rejected = session.seal.rejected
            sealed = [f for f in up if f[:1] == b"\xc1"]
            for f in up:
                proxy.inject(f)
            deadline = time.monotonic() + 5
            while session.seal.rejected < rejected + len(sealed) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert session.seal.rejected == rejected + len(sealed), "a replayed frame was accepted"
            assert set(send.transfers) <= {"first"} and b_pool.page_digests(list(range(32))) == before_pages
            move(recv, send, "second", [5, 6], [7, 8])
            assert b_pool.page_digests([7, 8]) == a_pool.page_digests([5, 6])
        finally:
            ctx.destroy(0)
            proxy.close()


# -- what is bound to a session ----------------------------------------------------------------


def test_a_live_connection_id_cannot_be_taken_over() -> None:
    with endpoint("prefill") as (prefill, a_pool), endpoint("decode") as (decode, b_pool):
        recv = decode.connect(prefill.address)
        send = prefill.accept(5)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = raw_socket(ctx, prefill.address)
            link = authenticate(sock, SECRET, conn=recv.id)  # an insider, holding the secret
            sock.send(link.seal(message("hello", conn=recv.id, hello={}, regions={}, lanes={})))
            (answer,) = received(sock, 2)
            body = link.open(answer)
            assert body is not None and msgpack.unpackb(body)["reason"].startswith("connection id")
        finally:
            ctx.destroy(0)
        assert prefill.connections[recv.id] is send
        move(recv, send, "still-mine", [1], [2])
        assert b_pool.page_digests([2]) == a_pool.page_digests([1])


def test_a_tag_belongs_to_the_connection_that_announced_it() -> None:
    """Two decode endpoints of the deployment announce the same tag: the first keeps it. The
    second's announcement fails (on its side only), its abort of the tag is ignored, a sender
    on its connection is refused, and the first's transfer lands, every byte right."""
    with (
        endpoint("prefill") as (prefill, a_pool),
        endpoint("decode") as (decode, b_pool),
        endpoint("other") as (other, c_pool),
    ):
        recv = decode.connect(prefill.address)
        send = prefill.accept(5)
        recv_other = other.connect(prefill.address)
        send_other = prefill.accept(5)
        mine = recv.expect("room", [3, 4])
        deadline = time.monotonic() + 5
        while prefill.announced("room") is None and time.monotonic() < deadline:
            time.sleep(0.001)
        theirs = recv_other.expect("room", [5, 6])
        with pytest.raises(TransferAborted, match="announced by another connection"):
            theirs.wait(5)
        other.call(lambda: recv_other._session.send("abort", tag="room", reason="hijack"))
        time.sleep(0.2)
        announced = prefill.announced("room")
        assert announced is not None and announced.id == send.id
        with pytest.raises(KVTransportError, match=r"announced by another connection \(decode\)"):
            send_other.sender("room").wait(5)
        t = announced.sender("room")
        deadline = time.monotonic() + 5
        while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
            time.sleep(0.001)
        t.send([1, 2], last=True)
        assert t.wait(5) is State.SUCCESS and mine.wait(5) is State.SUCCESS
        assert b_pool.page_digests([3, 4]) == a_pool.page_digests([1, 2])
        assert c_pool.page_digests([5, 6]) != a_pool.page_digests([1, 2])
        assert prefill.stats()["tag_owners"] <= 1


def test_a_flood_of_strangers_keeps_no_state_and_locks_nobody_out(caplog: pytest.LogCaptureFixture) -> None:
    """A hundred stranger sockets send 5,000 ``auth`` messages while three members connect:
    every connect succeeds (the challenge is a cookie: nothing is kept for a party that
    has not proved the secret, so nothing of a member's can be evicted), and the acceptor holds
    no pending state afterwards. A 4 MiB unsealed frame is dropped unread."""
    import threading

    with (
        endpoint("prefill") as (prefill, a_pool),
        endpoint("decode") as (decode, b_pool),
        endpoint("decode-2") as (second, _),
        endpoint("decode-3") as (third, _),
    ):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            socks = [raw_socket(ctx, prefill.address) for _ in range(100)]
            stop = threading.Event()

            def flood() -> None:
                for _ in range(50):
                    for sock in socks:
                        if stop.is_set():
                            return
                        sock.send(message("auth", conn=uuid.uuid4().hex, nonce=os.urandom(32)))

            thread = threading.Thread(target=flood)
            thread.start()
            try:
                conns = [ep.connect(prefill.address, timeout=10) for ep in (decode, second, third)]
            finally:
                stop.set()
                thread.join()
            assert all(c.alive for c in conns)
            big = msgpack.packb(
                {
                    "v": PROTOCOL_VERSION,
                    "t": "hello",
                    "conn": "c",
                    "hello": {"x": [[]] * (1 << 20)},
                    "regions": {},
                    "lanes": {},
                }
            )
            with caplog.at_level(logging.DEBUG, logger="kvtransport"):
                socks[0].send(big)
                deadline = time.monotonic() + 5
                while not any("dropped an unsealed frame of" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "the oversized unsealed frame was not dropped"
                    time.sleep(0.01)
            assert prefill.stats()["pending_auth"] == 0
            send = next(c for c in (prefill.accept(5) for _ in range(3)) if c.id == conns[0].id)
            move(conns[0], send, "after-flood", [1], [2])
            assert b_pool.page_digests([2]) == a_pool.page_digests([1])
        finally:
            ctx.destroy(0)


@settings(max_examples=200, deadline=None)
@given(key=st.binary(max_size=200), header=st.binary(max_size=16), body=st.binary(max_size=3000))
def test_frames_are_sealed_with_standard_hmac_sha256(key: bytes, header: bytes, body: bytes) -> None:
    """The seal's HMAC is built from two keyed SHA-256 states (fewer interpreter calls per
    frame); it must be exactly RFC 2104 HMAC-SHA256, as any other implementation computes it."""
    inner, outer = auth._hmac_states(key)
    assert auth._hmac(inner, outer, header, body) == hmac.new(key, header + body, hashlib.sha256).digest()
    # The keyed states are copied, never consumed: the next frame gets the same answer.
    assert auth._hmac(inner, outer, header, body) == hmac.new(key, header + body, hashlib.sha256).digest()
