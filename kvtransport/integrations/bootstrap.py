"""Where a prefill rank's endpoint can be reached: a small HTTP registry and its client.

Serving engines start one bootstrap server per prefill instance (SGLang: on the prefill host,
``--disaggregation-bootstrap-port``). Each prefill rank ``PUT``s its endpoint address and
parallel layout under its (dp, tp) rank; a decode rank ``GET``s the entry it needs, retrying
until it appears or a timeout passes. JSON over stdlib HTTP, so ``curl`` can inspect it:
``curl http://prefill:8998/route`` lists every registered rank. No engine is imported here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import ConfigError, ConnectError, ProtocolError

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
_FIELDS = {"address": str, "tp_rank": int, "tp_size": int, "dp_rank": int, "endpoint": str}


def _key(dp_rank: int, tp_rank: int) -> str:
    return f"{dp_rank}/{tp_rank}"


def _validated(doc: Any) -> dict[str, Any]:
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
    return out


class BootstrapServer:
    """The registry, served on a background thread until :meth:`close`."""

    def __init__(self, host: str, port: int) -> None:
        routes: dict[str, dict[str, Any]] = {}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("bootstrap %s: " + fmt, self.address_string(), *args)

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # http.server's naming
                if urllib.parse.urlsplit(self.path).path != "/route":
                    self._reply(404, {"error": "unknown path"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY:
                    self._reply(413, {"error": f"body must be 1..{MAX_BODY} bytes"})
                    return
                try:
                    route = _validated(json.loads(self.rfile.read(length)))
                except (ValueError, ProtocolError) as exc:
                    self._reply(400, {"error": str(exc)})
                    return
                with lock:
                    routes[_key(route["dp_rank"], route["tp_rank"])] = route
                self._reply(200, {"ok": True})

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                if url.path != "/route":
                    self._reply(404, {"error": "unknown path"})
                    return
                query = urllib.parse.parse_qs(url.query)
                with lock:
                    if "tp_rank" not in query:
                        self._reply(200, {"routes": list(routes.values())})
                        return
                    try:
                        key = _key(int(query.get("dp_rank", ["0"])[0]), int(query["tp_rank"][0]))
                    except ValueError:
                        self._reply(400, {"error": "dp_rank and tp_rank must be integers"})
                        return
                    route = routes.get(key)
                self._reply(200, route) if route else self._reply(404, {"error": f"no rank {key} registered"})

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"bootstrap server cannot listen on {host}:{port}: {exc}") from exc
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtransport-bootstrap", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class BootstrapClient:
    """Talks to the registry at ``host:port`` (what SGLang calls the bootstrap address)."""

    def __init__(self, bootstrap_addr: str, timeout: float = 5.0) -> None:
        self.base = "http://" + bootstrap_addr.removeprefix("http://")
        self.timeout = timeout

    def register(self, route: Mapping[str, Any]) -> None:
        body = json.dumps(_validated(dict(route))).encode()
        request = urllib.request.Request(f"{self.base}/route", data=body, method="PUT")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as exc:
            raise ConnectError(f"cannot register with the bootstrap server at {self.base}: {exc}") from exc

    def lookup(self, dp_rank: int, tp_rank: int, wait: float) -> dict[str, Any]:
        """The route of prefill rank (dp, tp), retrying until it is registered or ``wait`` passes."""
        url = f"{self.base}/route?dp_rank={dp_rank}&tp_rank={tp_rank}"
        deadline = time.monotonic() + wait
        last = ""
        while True:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                    return _validated(json.loads(resp.read()))
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}"
                if exc.code != 404:
                    raise ConnectError(f"bootstrap server at {self.base} answered {last}") from exc
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise ConnectError(
                    f"prefill rank dp={dp_rank} tp={tp_rank} did not appear at the bootstrap server {self.base} "
                    f"within {wait:g} s ({last})"
                )
            time.sleep(0.05)
