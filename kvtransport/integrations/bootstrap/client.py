"""The registry client: register and keep refreshing a rank (as its owner), look one up, remove it."""

from __future__ import annotations

import http.client
import json
import logging
import secrets
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from kvtransport.integrations.bootstrap.routes import Reply, route_ttl, validated
from kvtransport.integrations.bootstrap.server import MAX_BODY
from kvtransport.integrations.bootstrap.signing import CLOCK_SKEW, sign_request
from kvtransport.runtime.auth import RateLimitedLog, Secret, load_secret
from kvtransport.spi.errors import AuthenticationFailed, ConfigError, ConnectError

log = logging.getLogger(__name__)

#: Seconds between tries while the registry is not up yet (it starts beside the ranks, not
#: before them), doubling up to the cap.
FIRST_RETRY_S, MAX_RETRY_S = 0.5, 10.0


class RegistryUnreachable(ConnectError):
    """The bootstrap server did not answer (not running yet, or busy): worth trying again,
    unlike a refusal, which names what to fix."""


class BootstrapClient:
    """Talks to the registry at ``host:port`` (what SGLang calls the bootstrap address).

    Each instance is one owner: its random token binds the ranks it registers, so only this
    client can refresh or remove them. Writes are signed whenever a secret is configured."""

    #: It also publishes which DP rank took each room (``register_room``).
    serves_rooms = True

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
        #: Set while the route is registered (cleared until a background first try succeeds).
        self.registered = threading.Event()
        self._lock = threading.Lock()
        self._warnings = RateLimitedLog(log)

    def __repr__(self) -> str:  # never the owner token
        return f"BootstrapClient({self.base!r})"

    # -- writes -------------------------------------------------------------------------------

    def register(self, route: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Publish ``route`` under its (dp, tp) rank once; the server's answer (with its ``ttl``)."""
        clean = validated(dict(route))
        status, doc = self._write("PUT", "/route", {**clean, "owner": self.owner}, timeout)
        if status != 200:
            raise self._refusal(f"register rank dp={clean['dp_rank']} tp={clean['tp_rank']}", status, doc)
        with self._lock:
            self._route = clean
        self.registered.set()
        return doc

    def keep_registered(
        self, route: Mapping[str, Any], interval: float | None = None, *, first_wait: float | None = None
    ) -> bool:
        """Register ``route``, then re-register it on a daemon thread every ``interval`` seconds
        (a third of the server's ttl by default) until :meth:`close`.

        A refusal (wrong secret, rank held by another owner, bad route) raises. A server that
        does not answer within ``first_wait`` seconds (the client's timeout by default) is
        tried again in the background until it does, with a warning: a serving engine starts
        its registry beside its ranks, and the ranks may come up first. Returns whether the
        route is registered already."""
        clean = validated(dict(route))
        try:
            reply: Mapping[str, Any] | None = self.register(clean, timeout=first_wait)
        except RegistryUnreachable as exc:
            log.warning("bootstrap: %s; registering in the background until it answers", exc)
            reply = None
            with self._lock:
                self._route = clean
        interval = (
            (_refresh_interval(reply) if reply is not None else route_ttl() / 3) if interval is None else interval
        )
        if not interval > 0:
            raise ConfigError(f"refresh interval {interval!r} must be a positive number of seconds")
        with self._lock:
            self._interval = interval
            if reply is None:
                self.registered.clear()
            if self._keeper is None:
                self._stop.clear()
                self._keeper = threading.Thread(target=self._keep, name="kvtransport-bootstrap-refresh", daemon=True)
                self._keeper.start()
        return reply is not None

    def register_room(self, room: int, dp_rank: int, timeout: float | None = None) -> None:
        """Publish that DP rank ``dp_rank`` took request ``room`` (SGLang's ``/register_dp_rank``),
        for decode ranks of an instance that does not route by room number."""
        status, doc = self._write("POST", "/register_dp_rank", {"bootstrap_room": room, "dp_rank": dp_rank}, timeout)
        if status != 200:
            raise self._refusal(f"register room {room} on dp rank {dp_rank}", status, doc)

    def unregister(self, timeout: float | None = None) -> None:
        """Stop refreshing and remove the rank this client registered (a no-op if none)."""
        self.close()
        with self._lock:
            route, self._route = self._route, None
        registered = self.registered.is_set()
        self.registered.clear()
        if route is None or not registered:  # never got through: nothing to remove
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
        retry = FIRST_RETRY_S
        while not self._stop.wait(self._interval if self.registered.is_set() else retry):
            with self._lock:
                route = self._route
            if route is None:
                return
            first = not self.registered.is_set()
            try:
                self.register(route)
            except Exception as exc:  # noqa: BLE001 - the refresher must outlive any one failure
                retry = min(retry * 2, MAX_RETRY_S)
                self._warnings.warning(
                    "bootstrap: %s rank dp=%s tp=%s failed (next try in %g s): %s",
                    "registering" if first else "refreshing",
                    route["dp_rank"],
                    route["tp_rank"],
                    retry if first else self._interval,
                    exc,
                )
                continue
            self.registered.set()
            if first:
                log.info("bootstrap: rank dp=%s tp=%s registered at %s", route["dp_rank"], route["tp_rank"], self.base)

    def _write(self, method: str, target: str, doc: Mapping[str, Any], timeout: float | None = None) -> Reply:
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
                raise RegistryUnreachable(f"cannot reach the bootstrap server at {self.base}: {last}")
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

    def lookup(self, dp_rank: int, tp_rank: int, wait: float, stop: threading.Event | None = None) -> dict[str, Any]:
        """The route of prefill rank (dp, tp), retrying until it is registered or ``wait`` passes
        (or ``stop`` is set: its owner is shutting down)."""
        target = f"/route?dp_rank={dp_rank}&tp_rank={tp_rank}"
        deadline = time.monotonic() + wait
        last = ""
        while True:
            try:
                status, doc = self._exchange("GET", target, None, {}, time.monotonic() + self.timeout)
                if status == 200:
                    return validated(doc)
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
            if stop is not None and stop.wait(0.05):
                raise ConnectError(f"stopped looking up prefill rank dp={dp_rank} tp={tp_rank} at {self.base}")
            if stop is None:
                time.sleep(0.05)

    def _exchange(
        self, method: str, target: str, body: bytes | None, headers: Mapping[str, str], deadline: float
    ) -> Reply:
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
