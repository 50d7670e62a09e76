"""Where a prefill rank's endpoint can be reached: a small HTTP registry and its client.

Serving engines start one bootstrap server per prefill instance (SGLang: on the prefill host,
``--disaggregation-bootstrap-port``). Each prefill rank ``PUT``s its endpoint address and
parallel layout under its (dp, tp) rank and keeps refreshing it; a decode rank ``GET``s the
entry it needs, retrying until it appears or a timeout passes. JSON over stdlib HTTP, so
``curl`` can inspect it: ``curl http://prefill:8998/route`` lists every live rank. No engine is
imported here.

This module owns the registry's whole contract:

- **Who may write.** With a deployment secret (:func:`~kvtransport.auth.load_secret`) every
  ``PUT`` and ``DELETE`` carries ``Authorization: KVT1 ts=<unix s>,nonce=<32 hex>,mac=<hex>``
  where ``mac = secret.derive(b"bootstrap request", method, target, ts, nonce, sha256(body))``
  (each part as bytes: the request target is the path with its query as sent). A request whose
  MAC does not verify, whose timestamp is more than :data:`CLOCK_SKEW` seconds off, or whose
  nonce was already seen, is refused with 401 and the words "authentication failed" (the
  details go to this process's log, rate-limited). Without a secret the server may only bind
  loopback (:func:`~kvtransport.auth.control_plane_policy`) and writes are unsigned.
- **Who may replace a rank.** A client sends a random owner token with each registration; the
  first one binds the (dp, tp) key until the entry expires, and another owner gets 409.
- **How long a route lives.** ``ttl`` seconds after its last ``PUT`` (``KVTRANSPORT_BOOTSTRAP_
  ROUTE_TTL``, default 600); :meth:`BootstrapClient.keep_registered` refreshes it. At most
  ``max_routes`` live routes (507 beyond).
- **What a connection may cost.** Each must deliver its request within ``request_timeout``
  seconds, bodies are at most :data:`MAX_BODY` bytes, and at most ``max_connections`` are open
  at once (``max_connections_per_client`` from one address); excess ones are closed at once.

Reads stay open to anyone who reaches the port: an address alone is useless without the
control-plane secret, which every endpoint's handshake demands before it reveals or moves KV.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import http.client
import json
import logging
import re
import secrets
import socket
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from ..auth import RateLimitedLog, Secret, control_plane_policy, load_secret
from ..config import env_number
from ..errors import AuthenticationFailed, ConfigError, ConnectError, ProtocolError

log = logging.getLogger(__name__)

ENV_ROUTE_TTL = "KVTRANSPORT_BOOTSTRAP_ROUTE_TTL"
MAX_BODY = 64 * 1024
DEFAULT_TTL = 600.0
DEFAULT_MAX_ROUTES = 4096
#: Seconds a signed request's timestamp may be off the server's clock, either way.
CLOCK_SKEW = 60.0
#: Seconds a connection has to deliver its whole request and take the answer.
REQUEST_TIMEOUT = 5.0
MAX_CONNECTIONS = 64
#: Nonces remembered for the replay check. Only requests whose MAC verified are remembered, so
#: filling it takes the secret; a full cache refuses writes (503) until entries expire.
MAX_NONCES = 65536

_MAC_LABEL = b"bootstrap request"
_AUTH = re.compile(r"KVT1 ts=([0-9]{1,12}),nonce=([0-9a-f]{32}),mac=([0-9a-f]{64})")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_DIGITS = re.compile(r"[0-9]{1,12}")  # int() would also take "+1", " 1" and "1_0"
_FIELDS = {"address": str, "tp_rank": int, "tp_size": int, "dp_rank": int, "endpoint": str}
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_Reply = tuple[int, dict[str, Any]]


def route_ttl(env: Mapping[str, str] | None = None) -> float:
    """Seconds a route lives after its last refresh (``KVTRANSPORT_BOOTSTRAP_ROUTE_TTL``)."""
    return env_number(ENV_ROUTE_TTL, DEFAULT_TTL, env=env)


def _key(dp_rank: int, tp_rank: int) -> str:
    return f"{dp_rank}/{tp_rank}"


def _validated(doc: Any) -> dict[str, Any]:
    """The route fields of ``doc``, checked (anything else in it is dropped)."""
    if not isinstance(doc, dict):
        raise ProtocolError("a route must be a JSON object")
    out: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        value = doc.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProtocolError(f"route field {name!r} must be {kind.__name__}, got {value!r}")
        out[name] = value
    if not out["address"].startswith("tcp://"):
        raise ProtocolError(f"route address {out['address']!r} is not tcp://host:port")
    if not 0 <= out["tp_rank"] < out["tp_size"]:
        raise ProtocolError(f"tp_rank {out['tp_rank']} is outside tp_size {out['tp_size']}")
    if out["dp_rank"] < 0:
        raise ProtocolError(f"dp_rank {out['dp_rank']} is negative")
    return out


def _owner_of(doc: Any) -> str:
    owner = doc.get("owner") if isinstance(doc, dict) else None
    if not isinstance(owner, str) or not _HEX32.fullmatch(owner):
        raise ProtocolError("field 'owner' must be 32 lowercase hex digits (the registering client's token)")
    return owner


def _ranks_of(query: str) -> tuple[int, int]:
    """(dp_rank, tp_rank) of a ``?dp_rank=&tp_rank=`` query; dp_rank defaults to 0."""
    values = urllib.parse.parse_qs(query)
    dp, tp = values.get("dp_rank", ["0"])[0], values.get("tp_rank", [""])[0]
    if not (_DIGITS.fullmatch(dp) and _DIGITS.fullmatch(tp)):
        raise ProtocolError("dp_rank and tp_rank must be whole numbers")
    return int(dp), int(tp)


# -- routes -------------------------------------------------------------------------------------


@dataclass
class _Entry:
    route: dict[str, Any]
    owner: str
    expires: float  # on ``RouteTable``'s clock


class RouteTable:
    """Live routes by (dp, tp) rank, each bound to the owner that registered it first.
    Thread-safe. Expired entries are dropped lazily: reads skip them, writes remove them."""

    def __init__(self, ttl: float, max_routes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.max_routes, self._clock = ttl, max_routes, clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def put(self, route: dict[str, Any], owner: str) -> _Reply:
        key, now = _key(route["dp_rank"], route["tp_rank"]), self._clock()
        with self._lock:
            self._drop_expired(now)
            held = self._entries.get(key)
            if held is not None and not hmac.compare_digest(held.owner, owner):
                return 409, {"error": _held_message(route["dp_rank"], route["tp_rank"], held.expires - now)}
            if held is None and len(self._entries) >= self.max_routes:
                return 507, {"error": f"the registry holds {self.max_routes} live routes, its limit"}
            self._entries[key] = _Entry(route, owner, now + self.ttl)
        return 200, {"ok": True, "ttl": self.ttl}

    def delete(self, dp_rank: int, tp_rank: int, owner: str) -> _Reply:
        key, now = _key(dp_rank, tp_rank), self._clock()
        with self._lock:
            self._drop_expired(now)
            held = self._entries.get(key)
            if held is None:
                return 404, {"error": f"no rank {key} registered"}
            if not hmac.compare_digest(held.owner, owner):
                return 409, {"error": _held_message(dp_rank, tp_rank, held.expires - now)}
            del self._entries[key]
        return 200, {"ok": True}

    def get(self, dp_rank: int, tp_rank: int) -> dict[str, Any] | None:
        now = self._clock()
        with self._lock:
            entry = self._entries.get(_key(dp_rank, tp_rank))
            return _public(entry, now) if entry is not None and entry.expires > now else None

    def live(self) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return [_public(e, now) for e in self._entries.values() if e.expires > now]

    def _drop_expired(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            del self._entries[key]


def _public(entry: _Entry, now: float) -> dict[str, Any]:
    """What a reader sees: the route and how long it lives, never the owner token (knowing it
    is what lets a client replace or remove a rank)."""
    return {**entry.route, "expires_in": round(entry.expires - now, 3)}


def _held_message(dp_rank: int, tp_rank: int, remaining: float) -> str:
    return (
        f"rank dp={dp_rank} tp={tp_rank} is held by another owner; it expires in {max(remaining, 0):.0f} s "
        "unless that owner refreshes it"
    )


# -- request authentication ---------------------------------------------------------------------


def request_mac(secret: Secret, method: str, target: str, ts: str, nonce: str, body: bytes) -> bytes:
    """The MAC of one write: bound to the method, the target (path and query), the timestamp,
    the nonce and the body's digest, so no part of a captured request can be reused."""
    parts = (method.encode("latin-1"), target.encode("latin-1"), ts.encode(), nonce.encode())
    return secret.derive(_MAC_LABEL, *parts, hashlib.sha256(body).digest())


def sign_request(
    secret: Secret, method: str, target: str, body: bytes, *, ts: float | None = None, nonce: str | None = None
) -> str:
    """The ``Authorization`` header value for one write (fresh timestamp and nonce by default)."""
    stamp = str(int(time.time() if ts is None else ts))
    nonce = secrets.token_hex(16) if nonce is None else nonce
    return f"KVT1 ts={stamp},nonce={nonce},mac={request_mac(secret, method, target, stamp, nonce, body).hex()}"


class _ReplayCache:
    """Nonces of accepted requests until their timestamps leave the window; bounded."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # a heap: the next to forget first
        self._lock = threading.Lock()

    def admit(self, nonce: str, expires: float, now: float) -> _Reply | None:
        """None if ``nonce`` is new (it is remembered until ``expires``), else the refusal."""
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                return 401, {"error": "nonce already used: a replayed request"}
            if len(self._seen) >= self._limit:
                return 503, {"error": f"{self._limit} signed requests within {CLOCK_SKEW:g} s; retry later"}
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (expires, nonce))
        return None


class RequestVerifier:
    """Decides whether a write is authentic (always yes without a secret)."""

    def __init__(self, secret: Secret, skew: float = CLOCK_SKEW, max_nonces: int = MAX_NONCES) -> None:
        self.secret, self.skew = secret, skew
        self._replays = _ReplayCache(max_nonces)

    def refusal(self, method: str, target: str, header: str | None, body: bytes) -> _Reply | None:
        """None if the request may proceed; else the status and the reason (for the local log)."""
        if not self.secret.authenticated:
            return None
        match = _AUTH.fullmatch((header or "").strip())
        if match is None:
            return 401, {"error": "no Authorization header, or not 'KVT1 ts=..,nonce=..,mac=..'"}
        ts, nonce, mac = match.groups()
        now = time.time()
        if abs(now - int(ts)) > self.skew:
            return 401, {"error": f"timestamp {ts} is {now - int(ts):+.0f} s off this clock (allowed {self.skew:g})"}
        if not hmac.compare_digest(bytes.fromhex(mac), request_mac(self.secret, method, target, ts, nonce, body)):
            return 401, {"error": "the MAC does not verify: another secret, or an altered request"}
        return self._replays.admit(nonce, int(ts) + self.skew + 1, now)


# -- the server ---------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvtransport-bootstrap"
    sys_version = ""  # no need to tell strangers the Python version
    default_request_version = "HTTP/1.0"  # so even a garbled request line gets a status line back

    @property
    def _srv(self) -> _HTTPServer:
        return cast(_HTTPServer, self.server)

    def setup(self) -> None:
        # ``timeout`` (set per server, see _HTTPServer) bounds each read; the deadline bounds the
        # whole request, so a client dripping one byte per timeout cannot hold a slot for long.
        super().setup()
        self._deadline = threading.Timer(self._srv.request_timeout, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def finish(self) -> None:
        self._deadline.cancel()
        try:
            super().finish()
        except OSError:
            pass  # the peer is gone; nothing left to flush to

    def _cut(self) -> None:
        log.debug("bootstrap: %s took over %g s; disconnecting", self.client_address[0], self._srv.request_timeout)
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("bootstrap %s: " + fmt, self.address_string(), *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own (unparsable request, unknown method, ...) answers in HTML; this API is JSON.
        self.close_connection = True
        self._reply(code, {"error": message or HTTPStatus(code).phrase})

    def _reply(self, code: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code == 401:
            self.send_header("WWW-Authenticate", "KVT1")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # http.server's naming
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/route":
            self._reply(404, {"error": "unknown path"})
        elif "tp_rank" not in urllib.parse.parse_qs(url.query):
            self._reply(200, {"routes": self._srv.table.live()})
        else:
            try:
                dp, tp = _ranks_of(url.query)
            except ProtocolError as exc:
                self._reply(400, {"error": str(exc)})
                return
            route = self._srv.table.get(dp, tp)
            self._reply(200, route) if route else self._reply(404, {"error": f"no rank {_key(dp, tp)} registered"})

    def do_PUT(self) -> None:
        self._write(lambda url, doc: self._srv.table.put(_validated(doc), _owner_of(doc)))

    def do_DELETE(self) -> None:
        self._write(lambda url, doc: self._srv.table.delete(*_ranks_of(url.query), _owner_of(doc)))

    def _write(self, action: Callable[[urllib.parse.SplitResult, Any], _Reply]) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/route":
            self._reply(404, {"error": "unknown path"})
            return
        body = self._body()
        if body is None:
            return
        refused = self._srv.verifier.refusal(self.command, self.path, self.headers.get("Authorization"), body)
        if refused is not None:
            self._refuse(*refused)
            return
        try:
            self._reply(*action(url, json.loads(body)))
        except (ValueError, RecursionError) as exc:  # not JSON (or nested past the parser's depth)
            self._reply(400, {"error": f"the body is not a JSON document: {type(exc).__name__}"})
        except ProtocolError as exc:
            self._reply(400, {"error": str(exc)})

    def _refuse(self, code: int, why: Mapping[str, Any]) -> None:
        self._srv.warnings.warning(
            "bootstrap: refused %s %s from %s: %s", self.command, self.path[:200], self.client_address[0], why["error"]
        )
        # The stranger learns only that it failed, not which check (that is in our log).
        self._reply(code, {"error": "authentication failed"} if code == 401 else why)

    def _body(self) -> bytes | None:
        """The request body, or None after replying with why it cannot be taken."""
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers or not lengths:
            self._reply(411, {"error": "send the body with a Content-Length (chunked bodies are not taken)"})
            return None
        if len(lengths) > 1 or not _DIGITS.fullmatch(lengths[0].strip()):
            self._reply(400, {"error": "Content-Length must be one whole number of bytes"})
            return None
        length = int(lengths[0])
        if not 0 < length <= MAX_BODY:
            self._reply(413, {"error": f"body must be 1..{MAX_BODY} bytes"})
            return None
        body = self.rfile.read(length)
        if len(body) != length:  # the client closed (or was cut off) mid-body
            self.close_connection = True
            return None
        return body


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # close() must not wait for a slow client (its deadline ends it)
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        table: RouteTable,
        verifier: RequestVerifier,
        request_timeout: float,
        max_connections: int,
        max_per_client: int,
    ) -> None:
        self.table, self.verifier, self.request_timeout = table, verifier, request_timeout
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.warnings = RateLimitedLog(log)
        self._open: dict[str, int] = {}
        self._open_lock = threading.Lock()
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # StreamRequestHandler applies its class attribute ``timeout`` to each connection's socket.
        handler = type("BootstrapHandler", (_Handler,), {"timeout": request_timeout})
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer's own also resolves the host's FQDN (a DNS lookup nobody here needs).
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0])
        if not self._admit(client):
            self.warnings.warning("bootstrap: too many connections open; closing one from %s", client)
            self._close_at_once(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(client)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]))

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanishes mid-reply is routine; never a traceback on stderr.
        log.debug("bootstrap: connection from %s failed", client_address[0], exc_info=True)

    def _admit(self, client: str) -> bool:
        with self._open_lock:
            if sum(self._open.values()) >= self.max_connections or self._open.get(client, 0) >= self.max_per_client:
                return False
            self._open[client] = self._open.get(client, 0) + 1
        return True

    def _release(self, client: str) -> None:
        with self._open_lock:
            left = self._open.get(client, 1) - 1
            if left > 0:
                self._open[client] = left
            else:
                self._open.pop(client, None)

    def _close_at_once(self, request: socket.socket) -> None:
        try:
            request.setblocking(False)  # the accept loop never waits on a refused client
            request.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"bootstrap server: {name}={value!r} must be a positive number")
    return value


class BootstrapServer:
    """The registry, served on a background thread until :meth:`close`.

    Binds exactly ``host`` (a wildcard only when given one). ``secret`` defaults to the
    deployment's (:func:`~kvtransport.auth.load_secret`); without one a host reachable from
    elsewhere raises :class:`ConfigError` unless ``KVTRANSPORT_INSECURE=1``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: Secret | None = None,
        ttl: float | None = None,
        max_routes: int = DEFAULT_MAX_ROUTES,
        request_timeout: float = REQUEST_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_client: int | None = None,
    ) -> None:
        self.secret = load_secret() if secret is None else secret
        try:
            policy = control_plane_policy(f"tcp://{_host_port(host, port)}", self.secret)
        except ConfigError as exc:  # the same rule as an endpoint's: whoever rewrites routes redirects KV
            raise ConfigError(f"bootstrap server: {exc}") from None
        ttl = _positive("ttl", route_ttl() if ttl is None else ttl)
        per_client = max(1, max_connections // 4) if max_connections_per_client is None else max_connections_per_client
        for name, value in (("max_routes", max_routes), ("max_connections", max_connections)):
            _positive(name, value)
        table = RouteTable(ttl, max_routes)
        try:
            self._server = _HTTPServer(
                (host, port),
                table,
                RequestVerifier(self.secret),
                _positive("request_timeout", request_timeout),
                max_connections,
                int(_positive("max_connections_per_client", per_client)),
            )
        except OSError as exc:
            raise ConfigError(f"bootstrap server cannot listen on {_host_port(host, port)}: {exc}") from exc
        self.host, self.port = host, int(self._server.server_address[1])
        self.table = table
        # The poll interval is how long close() waits for the loop to notice (0.5 s by default).
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name="kvtransport-bootstrap", daemon=True
        )
        self._thread.start()
        log.info("bootstrap registry on %s, routes live %g s; %s", self.url, ttl, policy)

    @property
    def url(self) -> str:
        return f"http://{_host_port(self.host, self.port)}"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- the client ---------------------------------------------------------------------------------


class BootstrapClient:
    """Talks to the registry at ``host:port`` (what SGLang calls the bootstrap address).

    Each instance is one owner: its random token binds the ranks it registers, so only this
    client can refresh or remove them. Writes are signed whenever a secret is configured."""

    def __init__(self, bootstrap_addr: str, timeout: float = 5.0, *, secret: Secret | None = None) -> None:
        self.base = "http://" + bootstrap_addr.removeprefix("http://")
        try:
            url = urllib.parse.urlsplit(self.base)
            host, port = url.hostname, url.port
        except ValueError:
            host, port = None, None
        if not host or port is None:
            raise ConfigError(f"bootstrap address {bootstrap_addr!r} is not host:port")
        self._host, self._port = host, port
        self.timeout = timeout
        self.owner = secrets.token_hex(16)
        self._secret = secret  # loaded on the first write: a reader needs none
        self._route: dict[str, Any] | None = None
        self._interval = 0.0
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._warnings = RateLimitedLog(log)

    def __repr__(self) -> str:  # never the owner token
        return f"BootstrapClient({self.base!r})"

    # -- writes -------------------------------------------------------------------------------

    def register(self, route: Mapping[str, Any]) -> dict[str, Any]:
        """Publish ``route`` under its (dp, tp) rank once; the server's answer (with its ``ttl``)."""
        clean = _validated(dict(route))
        status, doc = self._write("PUT", "/route", {**clean, "owner": self.owner})
        if status != 200:
            raise self._refusal(f"register rank dp={clean['dp_rank']} tp={clean['tp_rank']}", status, doc)
        with self._lock:
            self._route = clean
        return doc

    def keep_registered(self, route: Mapping[str, Any], interval: float | None = None) -> None:
        """Register ``route`` now (raising if refused), then re-register it on a daemon thread
        every ``interval`` seconds (a third of the server's ttl by default) until :meth:`close`."""
        reply = self.register(route)
        interval = _refresh_interval(reply) if interval is None else interval
        if not interval > 0:
            raise ConfigError(f"refresh interval {interval!r} must be a positive number of seconds")
        with self._lock:
            self._interval = interval
            if self._keeper is not None:
                return  # the running refresher picks up the new route and interval
            self._stop.clear()
            self._keeper = threading.Thread(target=self._keep, name="kvtransport-bootstrap-refresh", daemon=True)
            self._keeper.start()

    def unregister(self, timeout: float | None = None) -> None:
        """Stop refreshing and remove the rank this client registered (a no-op if none)."""
        self.close()
        with self._lock:
            route, self._route = self._route, None
        if route is None:
            return
        target = f"/route?dp_rank={route['dp_rank']}&tp_rank={route['tp_rank']}"
        status, doc = self._write("DELETE", target, {"owner": self.owner}, timeout)
        if status not in (200, 404):  # 404: it had expired already
            raise self._refusal(f"unregister rank dp={route['dp_rank']} tp={route['tp_rank']}", status, doc)

    def close(self) -> None:
        """Stop the refresher (the route stays until it expires; :meth:`unregister` removes it)."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
            self._stop.set()
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(self.timeout + 1)

    def _keep(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                route = self._route
            if route is None:
                return
            try:
                self.register(route)
            except Exception as exc:  # noqa: BLE001 - the refresher must outlive any one failure
                self._warnings.warning(
                    "bootstrap: refreshing rank dp=%s tp=%s failed (next try in %g s): %s",
                    route["dp_rank"],
                    route["tp_rank"],
                    self._interval,
                    exc,
                )

    def _write(self, method: str, target: str, doc: Mapping[str, Any], timeout: float | None = None) -> _Reply:
        """One signed write, retried while the server is busy or unreachable, up to ``timeout``."""
        body = json.dumps(doc).encode()
        if self._secret is None:
            self._secret = load_secret()
        secret = self._secret
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        pause = 0.05
        while True:
            headers = {"Content-Type": "application/json"}
            if secret.authenticated:
                headers["Authorization"] = sign_request(secret, method, target, body)  # fresh nonce each try
            try:
                status, answer = self._exchange(method, target, body, headers, deadline)
                if status != 503:
                    return status, answer
                last = f"HTTP 503: {answer.get('error', 'busy')}"
            except (OSError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + pause >= deadline:
                raise ConnectError(f"cannot reach the bootstrap server at {self.base}: {last}")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _refusal(self, what: str, status: int, doc: Mapping[str, Any]) -> ConnectError:
        said = str(doc.get("error", doc))[:300]
        if status == 401:
            mine = self._secret
            source = f"this one's is from {mine.source}" if mine and mine.authenticated else "this one has none"
            return AuthenticationFailed(
                f"the bootstrap server at {self.base} refused to {what}: {said}. Every process of the "
                f"deployment needs the same KVTRANSPORT_SECRET ({source}) and a clock within "
                f"{CLOCK_SKEW:g} s of the server's"
            )
        return ConnectError(f"the bootstrap server at {self.base} refused to {what}: HTTP {status}: {said}")

    # -- reads --------------------------------------------------------------------------------

    def lookup(self, dp_rank: int, tp_rank: int, wait: float) -> dict[str, Any]:
        """The route of prefill rank (dp, tp), retrying until it is registered or ``wait`` passes."""
        target = f"/route?dp_rank={dp_rank}&tp_rank={tp_rank}"
        deadline = time.monotonic() + wait
        last = ""
        while True:
            try:
                status, doc = self._exchange("GET", target, None, {}, time.monotonic() + self.timeout)
                if status == 200:
                    return _validated(doc)
                last = f"HTTP {status}: {str(doc.get('error', doc))[:200]}"
                if status not in (404, 503):
                    raise ConnectError(f"bootstrap server at {self.base} answered {last}")
            except (OSError, http.client.HTTPException) as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise ConnectError(
                    f"prefill rank dp={dp_rank} tp={tp_rank} did not appear at the bootstrap server {self.base} "
                    f"within {wait:g} s ({last})"
                )
            time.sleep(0.05)

    def _exchange(
        self, method: str, target: str, body: bytes | None, headers: Mapping[str, str], deadline: float
    ) -> _Reply:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=max(deadline - time.monotonic(), 0.01))
        try:
            conn.request(method, target, body=body, headers=dict(headers))
            resp = conn.getresponse()
            data = resp.read(MAX_BODY + 1)
        finally:
            conn.close()
        try:
            doc = json.loads(data)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            doc = {"error": data[:200].decode(errors="replace")}
        return resp.status, doc


def _refresh_interval(reply: Mapping[str, Any]) -> float:
    """A third of the ttl the server announced (of this process's setting if it announced none),
    so one lost refresh never lets a route expire."""
    ttl = reply.get("ttl")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
        ttl = route_ttl()
    return float(ttl) / 3


__all__ = [
    "CLOCK_SKEW",
    "ENV_ROUTE_TTL",
    "MAX_BODY",
    "BootstrapClient",
    "BootstrapServer",
    "RequestVerifier",
    "RouteTable",
    "request_mac",
    "route_ttl",
    "sign_request",
]
