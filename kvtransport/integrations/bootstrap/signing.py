"""Signed writes: the MAC a client puts in ``Authorization``, and the server's check of it
(timestamp window, MAC, nonces already seen)."""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import threading
import time

from kvtransport.integrations.bootstrap.routes import Reply
from kvtransport.runtime.auth import Secret

#: Seconds a signed request's timestamp may be off the server's clock, either way.
CLOCK_SKEW = 60.0
#: Nonces remembered for the replay check. Only requests whose MAC verified are remembered, so
#: filling it takes the secret; a full cache refuses writes (503) until entries expire.
MAX_NONCES = 65536

_MAC_LABEL = b"bootstrap request"
_AUTH = re.compile(r"KVT1 ts=([0-9]{1,12}),nonce=([0-9a-f]{32}),mac=([0-9a-f]{64})")


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

    def admit(self, nonce: str, expires: float, now: float) -> Reply | None:
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

    def refusal(self, method: str, target: str, header: str | None, body: bytes) -> Reply | None:
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
