"""The HTTP server: one handler per request, bounded connections and time, the routes behind it."""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from kvtransport.integrations.bootstrap.routes import (
    DEFAULT_MAX_ROOMS,
    DEFAULT_MAX_ROUTES,
    DIGITS,
    Reply,
    RoomTable,
    RouteTable,
    owner_of,
    ranks_of,
    room_rank_of,
    rooms_of,
    route_key,
    route_ttl,
    validated,
)
from kvtransport.integrations.bootstrap.signing import RequestVerifier
from kvtransport.runtime.auth import RateLimitedLog, Secret, control_plane_policy, load_secret
from kvtransport.runtime.bounded import ConnectionQuota
from kvtransport.spi.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
#: SGLang's decode asks for every pending room of a prefill instance in one body (aiohttp,
#: which its own registry runs on, takes 1 MiB).
MAX_QUERY_BODY = 1 << 20
#: Seconds a connection has to deliver its whole request and take the answer.
REQUEST_TIMEOUT = 5.0
MAX_CONNECTIONS = 64
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


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
        if url.path == "/health":
            self._reply(200, {"ok": True})
        elif url.path != "/route":
            self._reply(404, {"error": "unknown path"})
        elif "tp_rank" not in urllib.parse.parse_qs(url.query):
            self._reply(200, {"routes": self._srv.table.live()})
        else:
            try:
                dp, tp = ranks_of(url.query)
            except ProtocolError as exc:
                self._reply(400, {"error": str(exc)})
                return
            route = self._srv.table.get(dp, tp)
            self._reply(200, route) if route else self._reply(404, {"error": f"no rank {route_key(dp, tp)} registered"})

    def do_PUT(self) -> None:
        self._write("/route", lambda url, doc: self._srv.table.put(validated(doc), owner_of(doc)))

    def do_DELETE(self) -> None:
        self._write("/route", lambda url, doc: self._srv.table.delete(*ranks_of(url.query), owner_of(doc)))

    def do_POST(self) -> None:
        # SGLang's names and bodies: a prefill sender publishes the DP rank that took a room
        # (a write, signed like the others), a decode rank asks for many rooms at once (a read:
        # SGLang's own client sends it, unsigned).
        path = urllib.parse.urlsplit(self.path).path
        if path == "/query_dp_ranks":
            self._write(
                path, lambda url, doc: (200, self._srv.rooms.query(rooms_of(doc))), signed=False, limit=MAX_QUERY_BODY
            )
        else:
            self._write("/register_dp_rank", lambda url, doc: self._srv.rooms.put(*room_rank_of(doc)))

    def _write(
        self,
        path: str,
        action: Callable[[urllib.parse.SplitResult, Any], Reply],
        signed: bool = True,
        limit: int = MAX_BODY,
    ) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != path:
            self._reply(404, {"error": "unknown path"})
            return
        body = self._body(limit)
        if body is None:
            return
        refused = (
            self._srv.verifier.refusal(self.command, self.path, self.headers.get("Authorization"), body)
            if signed
            else None
        )
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

    def _body(self, limit: int = MAX_BODY) -> bytes | None:
        """The request body, or None after replying with why it cannot be taken."""
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers or not lengths:
            self._reply(411, {"error": "send the body with a Content-Length (chunked bodies are not taken)"})
            return None
        if len(lengths) > 1 or not DIGITS.fullmatch(lengths[0].strip()):
            self._reply(400, {"error": "Content-Length must be one whole number of bytes"})
            return None
        length = int(lengths[0])
        if not 0 < length <= limit:
            self._reply(413, {"error": f"body must be 1..{limit} bytes"})
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
        rooms: RoomTable,
        verifier: RequestVerifier,
        request_timeout: float,
        max_connections: int,
        max_per_client: int,
    ) -> None:
        self.table, self.rooms, self.verifier, self.request_timeout = table, rooms, verifier, request_timeout
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.warnings = RateLimitedLog(log)
        self._quota = ConnectionQuota(max_connections, max_per_client)
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
        if not self._quota.admit(client):
            self.warnings.warning("bootstrap: too many connections open; closing one from %s", client)
            self._close_at_once(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._quota.release(client)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._quota.release(str(client_address[0]))

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanishes mid-reply is routine; never a traceback on stderr.
        log.debug("bootstrap: connection from %s failed", client_address[0], exc_info=True)

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
    deployment's (:func:`~kvtransport.runtime.auth.load_secret`); without one a host reachable from
    elsewhere raises :class:`ConfigError` unless ``KVTRANSPORT_INSECURE=1``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: Secret | None = None,
        ttl: float | None = None,
        max_routes: int = DEFAULT_MAX_ROUTES,
        max_rooms: int = DEFAULT_MAX_ROOMS,
        request_timeout: float = REQUEST_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_client: int | None = None,
    ) -> None:
        self.secret = load_secret() if secret is None else secret
        try:
            policy = control_plane_policy(f"tcp://{host_port(host, port)}", self.secret)
        except ConfigError as exc:  # the same rule as an endpoint's: whoever rewrites routes redirects KV
            raise ConfigError(f"bootstrap server: {exc}") from None
        ttl = _positive("ttl", route_ttl() if ttl is None else ttl)
        per_client = max(1, max_connections // 4) if max_connections_per_client is None else max_connections_per_client
        for name, value in (("max_routes", max_routes), ("max_rooms", max_rooms), ("max_connections", max_connections)):
            _positive(name, value)
        table = RouteTable(ttl, max_routes)
        # A room is asked for within the decode side's bootstrap wait (SGLang: 300 s) or never.
        self.rooms = RoomTable(min(ttl, 600.0), max_rooms)
        try:
            self._server = _HTTPServer(
                (host, port),
                table,
                self.rooms,
                RequestVerifier(self.secret),
                _positive("request_timeout", request_timeout),
                max_connections,
                int(_positive("max_connections_per_client", per_client)),
            )
        except OSError as exc:
            raise ConfigError(f"bootstrap server cannot listen on {host_port(host, port)}: {exc}") from exc
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
        return f"http://{host_port(self.host, self.port)}"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
