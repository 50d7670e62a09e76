"""The bootstrap registry against what a stranger on the network can send: every test talks to a
real server over real sockets (http.client or raw bytes), never to the handler's methods."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.integrations.bootstrap import BootstrapClient, BootstrapServer, sign_request
from kvtransport.runtime.auth import Secret, load_secret
from kvtransport.spi.errors import AuthenticationFailed, ConfigError, ConnectError, ProtocolError

from .conftest import unused_port

SECRET = load_secret(secrets.token_hex(32))
OTHER_SECRET = load_secret(secrets.token_hex(32))
SECURITY_ENV = ("KVTRANSPORT_SECRET", "KVTRANSPORT_SECRET_FILE", "KVTRANSPORT_INSECURE")


def route(tp_rank: int = 0, address: str = "tcp://10.0.0.1:5000", tp_size: int = 8) -> dict[str, Any]:
    return {"address": address, "tp_rank": tp_rank, "tp_size": tp_size, "dp_rank": 0, "endpoint": f"prefill-{tp_rank}"}


@pytest.fixture(autouse=True)
def no_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*SECURITY_ENV, "KVTRANSPORT_BOOTSTRAP_ROUTE_TTL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_server() -> Iterator[Callable[..., BootstrapServer]]:
    servers: list[BootstrapServer] = []

    def make(port: int = 0, **kw: Any) -> BootstrapServer:
        kw.setdefault("secret", SECRET)
        # Long enough for a loaded machine to read and answer a large request; the tests of
        # slow clients pass their own.
        kw.setdefault("request_timeout", 5.0)
        servers.append(BootstrapServer("127.0.0.1", port, **kw))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def server(make_server: Callable[..., BootstrapServer]) -> BootstrapServer:
    return make_server()


def client(server: BootstrapServer, secret: Secret = SECRET) -> BootstrapClient:
    return BootstrapClient(f"127.0.0.1:{server.port}", timeout=2.0, secret=secret)


def call(
    server: BootstrapServer, method: str, target: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, bytes]:
    """One plain HTTP exchange: status, parsed JSON (or None) and the raw body."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    return resp.status, doc, data


def signed(
    server: BootstrapServer,
    method: str,
    target: str,
    doc: Any,
    secret: Secret = SECRET,
    **sign: Any,
) -> tuple[int, Any, bytes]:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    auth = sign_request(secret, method, target, body, **sign)
    return call(server, method, target, body, {"Authorization": auth, "Content-Type": "application/json"})


def lookup(server: BootstrapServer, tp_rank: int = 0) -> tuple[int, Any]:
    status, doc, _ = call(server, "GET", f"/route?dp_rank=0&tp_rank={tp_rank}")
    return status, doc


def raw(port: int, data: bytes, timeout: float = 5.0, source: str = "127.0.0.1") -> bytes:
    """Send bytes, half-close, and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def assert_serves(server: BootstrapServer, tp_rank: int = 7) -> None:
    """The server still takes a legit write and answers a read."""
    c = client(server)
    c.register(route(tp_rank, address=f"tcp://10.0.0.9:{6000 + tp_rank}"))
    assert c.lookup(0, tp_rank, wait=1)["address"] == f"tcp://10.0.0.9:{6000 + tp_rank}"
    assert server._thread.is_alive()


# -- authenticated writes -----------------------------------------------------------------------


def test_a_stranger_without_the_secret_cannot_register_and_the_route_is_unchanged(server: BootstrapServer) -> None:
    client(server).register(route(address="tcp://10.0.0.1:5000"))
    evil = json.dumps({**route(address="tcp://6.6.6.6:1"), "owner": "0" * 32}).encode()

    status, doc, _ = call(server, "PUT", "/route", evil, {"Content-Type": "application/json"})
    assert (status, doc) == (401, {"error": "authentication failed"})
    forged = f"KVT1 ts={int(time.time())},nonce={'a' * 32},mac={'b' * 64}"
    status, doc, _ = call(server, "PUT", "/route", evil, {"Authorization": forged})
    assert (status, doc) == (401, {"error": "authentication failed"})
    # Nor can it remove the rank.
    status, _, _ = call(server, "DELETE", "/route?dp_rank=0&tp_rank=0", b'{"owner": "' + b"0" * 32 + b'"}')
    assert status == 401

    assert lookup(server)[1]["address"] == "tcp://10.0.0.1:5000"


def test_a_client_with_another_secret_is_refused(server: BootstrapServer) -> None:
    client(server).register(route(address="tcp://10.0.0.1:5000"))
    with pytest.raises(AuthenticationFailed, match=r"authentication failed.*KVTRANSPORT_SECRET"):
        client(server, OTHER_SECRET).register(route(address="tcp://6.6.6.6:1"))
    status, doc, _ = signed(server, "PUT", "/route", {**route(), "owner": "1" * 32}, OTHER_SECRET)
    assert (status, doc) == (401, {"error": "authentication failed"})
    # A client without any secret is refused the same way, naming the cure.
    with pytest.raises(AuthenticationFailed, match="this one has none"):
        client(server, Secret.none()).register(route(address="tcp://6.6.6.6:1"))
    assert lookup(server)[1]["address"] == "tcp://10.0.0.1:5000"


def test_a_captured_signed_put_cannot_be_replayed(server: BootstrapServer) -> None:
    owner = secrets.token_hex(16)
    body = json.dumps({**route(address="tcp://10.0.0.1:5000"), "owner": owner}).encode()
    auth = sign_request(SECRET, "PUT", "/route", body)
    wire = (
        b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nAuthorization: %s\r\n\r\n"
        % (len(body), auth.encode())
        + body
    )
    assert status_of(raw(server.port, wire)) == 200
    assert status_of(raw(server.port, wire)) == 401  # the same bytes again

    # Its header on another body, or on another target, does not verify either.
    other = body.replace(b"10.0.0.1:5000", b"6.6.6.6:0001")
    assert call(server, "PUT", "/route", other, {"Authorization": auth})[0] == 401
    fresh = sign_request(SECRET, "PUT", "/route", body)
    assert call(server, "PUT", "/route?x=1", body, {"Authorization": fresh})[0] == 401
    assert lookup(server)[1]["address"] == "tcp://10.0.0.1:5000"


def test_a_timestamp_outside_the_window_is_refused(server: BootstrapServer) -> None:
    doc = {**route(), "owner": secrets.token_hex(16)}
    assert signed(server, "PUT", "/route", doc, ts=time.time() - 120)[0] == 401
    assert signed(server, "PUT", "/route", doc, ts=time.time() + 120)[0] == 401
    assert lookup(server)[0] == 404
    assert signed(server, "PUT", "/route", doc, ts=time.time() - 30)[0] == 200  # skew within 60 s is fine


def test_without_a_secret_loopback_writes_need_no_signature(make_server: Callable[..., BootstrapServer]) -> None:
    server = make_server(secret=Secret.none())
    status, _, _ = call(server, "PUT", "/route", json.dumps({**route(), "owner": "a" * 32}).encode())
    assert status == 200
    # A client that holds a secret signs anyway; a server without one does not mind.
    client(server).register(route(tp_rank=1))
    assert lookup(server, 1)[0] == 200


# -- ownership ----------------------------------------------------------------------------------


def test_another_owner_cannot_replace_a_rank_and_the_owner_can_refresh(server: BootstrapServer) -> None:
    legit, other = client(server), client(server)
    legit.register(route(address="tcp://10.0.0.1:5000"))

    with pytest.raises(ConnectError, match=r"HTTP 409: rank dp=0 tp=0 is held by another owner; it expires in \d+ s"):
        other.register(route(address="tcp://10.0.0.2:5000"))
    status, doc, _ = signed(server, "PUT", "/route", {**route(address="tcp://10.0.0.2:5000"), "owner": other.owner})
    assert status == 409 and "dp=0 tp=0" in doc["error"]
    status, _, _ = signed(server, "DELETE", "/route?dp_rank=0&tp_rank=0", {"owner": other.owner})
    assert status == 409
    assert lookup(server)[1]["address"] == "tcp://10.0.0.1:5000"

    legit.register(route(address="tcp://10.0.0.1:5001"))  # its owner may change it
    assert lookup(server)[1]["address"] == "tcp://10.0.0.1:5001"
    legit.unregister()
    assert lookup(server)[0] == 404
    other.register(route(address="tcp://10.0.0.2:5000"))  # free again


def test_get_never_shows_the_owner(server: BootstrapServer) -> None:
    c = client(server)
    c.register(route())
    for target in ("/route", "/route?dp_rank=0&tp_rank=0"):
        status, doc, data = call(server, "GET", target)
        assert status == 200
        assert c.owner.encode() not in data and b"owner" not in data
    assert set(doc) == {
        *("address", "tp_rank", "tp_size", "dp_rank", "endpoint", "expires_in"),
        # what decode routes by, with their single-DP-rank defaults
        *("dp_size", "follow_bootstrap_room", "page_size", "kv_cache_dtype"),
    }
    assert (doc["dp_size"], doc["follow_bootstrap_room"]) == (1, True)
    refused = signed(server, "PUT", "/route", {**route(), "owner": "f" * 32})[2]
    assert c.owner.encode() not in refused
    assert c.owner not in repr(c)


# -- expiry and bounds --------------------------------------------------------------------------


def test_an_expired_route_disappears_and_another_owner_can_claim_it(
    make_server: Callable[..., BootstrapServer],
) -> None:
    server = make_server(ttl=1.0)
    first, second = client(server), client(server)
    first.register(route(address="tcp://10.0.0.1:5000"))
    assert lookup(server)[0] == 200
    time.sleep(1.5)
    assert lookup(server)[0] == 404
    assert call(server, "GET", "/route")[1] == {"routes": []}
    second.register(route(address="tcp://10.0.0.2:5000"))
    assert lookup(server)[1]["address"] == "tcp://10.0.0.2:5000"
    with pytest.raises(ConnectError, match="409"):
        first.register(route(address="tcp://10.0.0.1:5000"))


def test_keep_registered_outlives_the_ttl_until_unregistered(make_server: Callable[..., BootstrapServer]) -> None:
    server = make_server(ttl=1.5)
    c = client(server)
    c.keep_registered(route())  # a third of the server's ttl by default
    time.sleep(4)  # well past the ttl: only the refreshes keep it
    assert lookup(server)[0] == 200
    c.unregister()
    assert lookup(server)[0] == 404
    time.sleep(0.8)  # the refresher is gone: nothing brings it back
    assert lookup(server)[0] == 404


def test_keep_registered_survives_a_registry_restart(make_server: Callable[..., BootstrapServer]) -> None:
    # A port outside the ephemeral range: the client's own connections cannot take it while
    # the registry is down.
    port = unused_port()
    server = make_server(port, ttl=5)
    c = client(server)
    c.keep_registered(route(), interval=0.1)
    server.close()
    time.sleep(0.3)  # refreshes fail meanwhile (logged), the thread keeps going
    again = BootstrapServer("127.0.0.1", port, secret=SECRET, request_timeout=0.5)
    try:
        deadline = time.monotonic() + 3
        while lookup(again)[0] != 200:
            assert time.monotonic() < deadline, "the route was not re-registered"
            time.sleep(0.05)
    finally:
        c.close()
        again.close()


def test_the_number_of_live_routes_is_bounded(make_server: Callable[..., BootstrapServer]) -> None:
    server = make_server(max_routes=3)
    clients = [client(server) for _ in range(4)]
    for tp, c in enumerate(clients[:3]):
        c.register(route(tp))
    with pytest.raises(ConnectError, match="HTTP 507: the registry holds 3 live routes"):
        clients[3].register(route(3))
    clients[0].register(route(0, address="tcp://10.0.0.1:5999"))  # a refresh is not a new route
    clients[1].unregister()
    clients[3].register(route(3))
    assert len(call(server, "GET", "/route")[1]["routes"]) == 3


def test_route_ttl_comes_from_the_environment(
    make_server: Callable[..., BootstrapServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTRANSPORT_BOOTSTRAP_ROUTE_TTL", "0.25")
    assert client(make_server()).register(route())["ttl"] == 0.25
    monkeypatch.setenv("KVTRANSPORT_BOOTSTRAP_ROUTE_TTL", "ten")
    with pytest.raises(ConfigError, match="KVTRANSPORT_BOOTSTRAP_ROUTE_TTL='ten'"):
        make_server()


# -- slow and hostile clients -------------------------------------------------------------------


def _closed_within(s: socket.socket, limit: float) -> float:
    """Seconds until the server closed ``s`` (reading whatever it sent first)."""
    start = time.monotonic()
    s.settimeout(limit)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for over {limit} s")
    return time.monotonic() - start


def test_a_half_sent_request_neither_blocks_others_nor_stays_connected(
    make_server: Callable[..., BootstrapServer],
) -> None:
    server = make_server(request_timeout=1.5)
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(b"PUT /route HTTP/1.1\r\nContent-Length: 100\r\n")  # and then nothing
    start = time.monotonic()
    assert_serves(server)
    assert time.monotonic() - start < 1.0  # served while the slow one still hangs
    _closed_within(slow, 4)
    assert 1.0 < time.monotonic() - start < 4  # ... which is then dropped at its timeout
    slow.close()


def test_a_client_dripping_bytes_is_cut_off_at_the_deadline(make_server: Callable[..., BootstrapServer]) -> None:
    server = make_server(request_timeout=0.5)
    drip = socket.create_connection(("127.0.0.1", server.port))
    stop = threading.Event()

    def feed() -> None:  # one byte every 0.1 s: each read is quick, the request never ends
        try:
            for b in b"GET /route?tp_rank=0" + b"0" * 1000:
                if stop.wait(0.1):
                    return
                drip.send(bytes([b]))
        except OSError:
            return

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        assert _closed_within(drip, 3) < 1.5  # the deadline is 0.5 s
    finally:
        stop.set()
        feeder.join(2)
        drip.close()
    assert_serves(server)


def test_idle_connections_beyond_the_limit_are_closed_at_once(make_server: Callable[..., BootstrapServer]) -> None:
    server = make_server(max_connections=4, max_connections_per_client=4, request_timeout=1.5)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    try:
        time.sleep(0.1)  # accepted in order: the first four hold the slots
        refused = [s for s in idle[4:] if _closed_within(s, 1.0) < 1.0]
        assert len(refused) == 6
        for s in idle[:4]:  # the four that were taken are still open, waiting for a request
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        time.sleep(1.6)  # the four time out ...
        assert_serves(server)  # ... and the server serves again
    finally:
        for s in idle:
            s.close()


def test_one_address_cannot_take_every_connection_slot(make_server: Callable[..., BootstrapServer]) -> None:
    server = make_server(max_connections=8, max_connections_per_client=2, request_timeout=1.5)
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), source_address=("127.0.0.2", 0)) for _ in range(5)]
    except OSError as exc:  # pragma: no cover - a loopback without 127.0.0.0/8
        pytest.skip(f"cannot use 127.0.0.2 as a source address here: {exc}")
    try:
        time.sleep(0.1)
        assert sum(_closed_within(s, 1.0) < 1.0 for s in idle[2:]) == 3
        start = time.monotonic()
        assert_serves(server)  # from 127.0.0.1, while 127.0.0.2 still holds its two
        assert time.monotonic() - start < 1.0
    finally:
        for s in idle:
            s.close()


def _put_wire(headers: bytes, body: bytes = b"") -> bytes:
    return b"PUT /route HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + body


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        (_put_wire(b"Content-Length: abc\r\n", b"{}"), 400),
        (_put_wire(b"Content-Length: -5\r\n", b"{}"), 400),
        (_put_wire(b"Content-Length: +2\r\n", b"{}"), 400),
        (_put_wire(b"Content-Length: 1e3\r\n", b"{}"), 400),
        (_put_wire(b"Content-Length: 2\r\nContent-Length: 2\r\n", b"{}"), 400),
        (_put_wire(b"Content-Length: 99999999999\r\n"), 413),
        (_put_wire(b"Content-Length: 0\r\n"), 413),
        (_put_wire(b""), 411),
        (_put_wire(b"Transfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n"), 411),
        (b"\x00\xff\xfe garbage\r\n\r\n", 400),
        (b"BREW /route HTTP/1.1\r\n\r\n", 501),
        (b"GET /route?tp_rank=abc HTTP/1.1\r\n\r\n", 400),
        (b"GET /route?tp_rank=%2B1 HTTP/1.1\r\n\r\n", 400),
        (b"GET /elsewhere HTTP/1.1\r\n\r\n", 404),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    ],
)
def test_malformed_requests_get_4xx_and_the_server_still_serves(
    server: BootstrapServer, wire: bytes, expected: int
) -> None:
    assert status_of(raw(server.port, wire)) == expected
    assert_serves(server)


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"{not json", "not a JSON document"),
        (b"\xff\xfe\xfa", "not a JSON document"),
        (b"[" * 60000, "not a JSON document"),  # deeper than the parser goes
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({**route(), "owner": "X" * 32}).encode(), "'owner' must be 32 lowercase hex"),
        (json.dumps(route()).encode(), "'owner'"),
        (json.dumps({**route(), "tp_rank": 9, "owner": "a" * 32}).encode(), "outside tp_size"),
        (json.dumps({**route(), "address": "http://x", "owner": "a" * 32}).encode(), "is not tcp://"),
    ],
)
def test_authentic_but_malformed_bodies_get_400(server: BootstrapServer, body: bytes, complaint: str) -> None:
    status, doc, _ = signed(server, "PUT", "/route", body)
    assert status == 400 and complaint in doc["error"]
    assert_serves(server)


def test_an_oversized_body_is_refused_before_it_is_read(server: BootstrapServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(_put_wire(b"Content-Length: %d\r\n" % (64 * 1024 + 1)))
        assert status_of(s.recv(4096)) == 413  # without waiting for the 64 KiB
    assert_serves(server)


@settings(max_examples=60)
@given(junk=st.binary(max_size=2048))
def test_no_bytes_a_client_sends_stop_the_server(junk: bytes) -> None:
    server = _shared_server()
    try:
        answer = raw(server.port, junk, timeout=3)
    except OSError:
        answer = b""
    assert answer == b"" or 400 <= status_of(answer) < 600
    assert server._thread.is_alive()
    assert lookup(server, 5)[0] in (200, 404)


_SHARED: list[BootstrapServer] = []


def _shared_server() -> BootstrapServer:
    """One server for every example of the property test (hypothesis reruns the function body)."""
    if not _SHARED:
        _SHARED.append(BootstrapServer("127.0.0.1", 0, secret=SECRET, request_timeout=0.5))
    return _SHARED[0]


@pytest.fixture(scope="module", autouse=True)
def _close_shared() -> Iterator[None]:
    yield
    for server in _SHARED:
        server.close()
    _SHARED.clear()


# -- where it listens ---------------------------------------------------------------------------


def test_it_binds_exactly_the_host_it_is_given(server: BootstrapServer) -> None:
    assert server._server.socket.getsockname()[0] == "127.0.0.1"
    try:
        probe = socket.create_connection(("127.0.0.2", server.port), timeout=1)
    except ConnectionRefusedError:
        return
    except OSError as exc:  # pragma: no cover - a loopback without 127.0.0.0/8
        pytest.skip(f"cannot reach 127.0.0.2 here: {exc}")
    probe.close()
    pytest.fail("a server given 127.0.0.1 answered on 127.0.0.2: it bound a wildcard")


def test_a_non_loopback_bind_without_a_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        BootstrapServer("0.0.0.0", 0)
    assert "KVTRANSPORT_SECRET" in str(info.value) and "KVTRANSPORT_INSECURE" in str(info.value)

    monkeypatch.setenv("KVTRANSPORT_SECRET", secrets.token_hex(32))  # with the deployment's secret it may
    BootstrapServer("0.0.0.0", 0).close()
    monkeypatch.delenv("KVTRANSPORT_SECRET")
    monkeypatch.setenv("KVTRANSPORT_INSECURE", "1")  # or on a network declared trusted
    insecure = BootstrapServer("0.0.0.0", 0)
    assert insecure._server.socket.getsockname()[0] == "0.0.0.0"
    insecure.close()


# -- registration before the registry is up ----------------------------------------------------


def test_a_rank_that_starts_before_its_registry_registers_once_it_is_up() -> None:
    # SGLang starts the registry beside the ranks: a rank may ask before anyone listens.
    port = unused_port()
    c = BootstrapClient(f"127.0.0.1:{port}", timeout=0.2, secret=SECRET)
    assert c.keep_registered(route(), interval=5, first_wait=0.2) is False
    assert not c.registered.is_set()
    time.sleep(0.3)
    later = BootstrapServer("127.0.0.1", port, secret=SECRET, request_timeout=0.5)
    try:
        assert c.registered.wait(5), "the background registration never got through"
        status, doc = lookup(later)
        assert (status, doc["address"]) == (200, route()["address"])
        c.unregister(timeout=1)
        assert lookup(later)[0] == 404
    finally:
        c.close()
        later.close()


def test_a_refusal_at_start_up_raises_instead_of_retrying(server: BootstrapServer) -> None:
    # A wrong secret is the operator's to fix: retrying in the background would hide it.
    wrong = client(server, OTHER_SECRET)
    with pytest.raises(AuthenticationFailed):
        wrong.keep_registered(route(), first_wait=1)
    assert lookup(server)[0] == 404


# -- which DP rank took a room (SGLang's /register_dp_rank and /query_dp_ranks) ----------------


def test_decode_learns_a_rooms_dp_rank_through_sglangs_own_query(server: BootstrapServer) -> None:
    pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="needs sglang==0.5.23")
    pytest.importorskip("transformers", reason="needs SGLang's import-time dependencies")
    c = client(server)
    c.register_room(7, 1)
    c.register_room(8, 0)
    # SGLang's decode scheduler asks with its own client (decode.py, _resolve_pending_reqs),
    # in a process of its own: its module needs the torchvision stand-in.
    code = (
        "import json, sys; from sglang.srt.disaggregation.common.conn import CommonKVReceiver as R; "
        "print(json.dumps(R.query_prefill_dp_ranks(sys.argv[1], [7, 8, 9])))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "stand_ins"), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", code, f"127.0.0.1:{server.port}"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"7": 1, "8": 0}


def test_registering_a_room_needs_the_secret(server: BootstrapServer) -> None:
    body = {"bootstrap_room": 5, "dp_rank": 1}
    assert call(server, "POST", "/register_dp_rank", json.dumps(body).encode())[0] == 401
    assert signed(server, "POST", "/register_dp_rank", body, secret=OTHER_SECRET)[0] == 401
    assert call(server, "POST", "/query_dp_ranks", json.dumps({"bootstrap_rooms": [5]}).encode())[1] == {}
    assert signed(server, "POST", "/register_dp_rank", body)[0] == 200
    assert call(server, "POST", "/query_dp_ranks", json.dumps({"bootstrap_rooms": [5]}).encode())[1] == {"5": 1}


@pytest.mark.parametrize(
    "target, doc",
    [
        ("/register_dp_rank", {"bootstrap_room": -1, "dp_rank": 0}),
        ("/register_dp_rank", {"bootstrap_room": 2**64, "dp_rank": 0}),
        ("/register_dp_rank", {"bootstrap_room": "7", "dp_rank": 0}),
        ("/register_dp_rank", {"bootstrap_room": 7, "dp_rank": True}),
        ("/register_dp_rank", [7, 0]),
        ("/query_dp_ranks", {"bootstrap_rooms": "7"}),
        ("/query_dp_ranks", {"bootstrap_rooms": [1.5]}),
        ("/query_dp_ranks", {"bootstrap_rooms": list(range(65537))}),
    ],
)
def test_malformed_room_requests_get_400(server: BootstrapServer, target: str, doc: Any) -> None:
    status, answer, _ = signed(server, "POST", target, doc)
    assert status == 400, answer
    assert_serves(server)


def test_the_room_table_is_bounded_oldest_first(make_server: Callable[..., BootstrapServer]) -> None:
    server = make_server(max_rooms=3)
    c = client(server)
    for room in range(5):
        c.register_room(room, room % 2)
    assert len(server.rooms) == 3
    answer = call(server, "POST", "/query_dp_ranks", json.dumps({"bootstrap_rooms": list(range(5))}).encode())[1]
    assert answer == {"2": 0, "3": 1, "4": 0}


def test_routes_carry_the_instances_dp_layout(server: BootstrapServer) -> None:
    c = client(server)
    c.register({**route(), "dp_rank": 1, "dp_size": 2, "follow_bootstrap_room": False, "page_size": 64})
    doc = c.lookup(1, 0, wait=1)
    assert (doc["dp_size"], doc["follow_bootstrap_room"], doc["page_size"]) == (2, False, 64)
    with pytest.raises(ProtocolError, match="dp_rank 2 is outside dp_size 2"):
        c.register({**route(), "dp_rank": 2, "dp_size": 2})
    assert call(server, "GET", "/health")[0] == 200


def test_a_query_for_thousands_of_pending_rooms_is_answered(server: BootstrapServer) -> None:
    # SGLang asks for every pending room of an instance at once: 63-bit rooms, ~21 bytes each.
    c = client(server)
    c.register_room(2**62 + 5, 1)
    rooms = [2**62 + i for i in range(10_000)]
    status, answer, _ = call(server, "POST", "/query_dp_ranks", json.dumps({"bootstrap_rooms": rooms}).encode())
    assert (status, answer) == (200, {str(2**62 + 5): 1})
