"""What an acceptor learns from connections that fail authentication, and how much of it it
may believe (docs/security.md, "What the acceptor sees of a failed authentication").

A peer whose proof does not verify is a stranger: nothing it sent can be believed (its
connection id and nonces are its own to choose, and it never gets to say hello). What this side
does know is that a party at a TCP source address completed a round trip with it (the challenge
is a cookie bound to the connection it went out on, and the proof echoed it) and runs
kvtransport's protocol under another secret, or none. In a deployment that is almost always one
of its own processes started with another ``KVTRANSPORT_SECRET``, and requests this side holds
may be waiting for that process's announcement, which will never come.

:class:`AuthFailures` keeps that, bounded: a total, the failures of the last few minutes
(coalesced, so a flood holds at most :data:`MAX_ENTRIES` entries), and the time and source
address of the last one; it warns at most once per window, never per attempt. An integration
asks :meth:`AuthFailures.seen_around` whether failures came close enough to a waiting request's
arrival to name them as the likely reason it waits (SGLang's prefill sender does).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: Seconds over which failures are counted ("N in the last 60 s") and between two warnings.
WINDOW_S = 60.0
#: Entries kept at most, however many failures arrive: closer ones are counted together.
MAX_ENTRIES = 600
#: Characters of a source address kept (an IPv6 address with a zone fits).
MAX_SOURCE_CHARS = 64


class AuthFailures:
    """Connections to one endpoint that failed authentication. ``record`` on the I/O thread;
    everything else from any thread.

    ``keep``: seconds of failures kept for :meth:`seen_around` (at least the window); entries
    closer together than ``keep / MAX_ENTRIES`` are merged, so memory does not grow with a
    flood."""

    def __init__(self, endpoint: str, secret_source: str, *, keep: float = WINDOW_S, window: float = WINDOW_S) -> None:
        self._endpoint = endpoint
        self._secret_source = secret_source
        self.window = window
        self._keep = max(keep, window)
        self._spacing = self._keep / MAX_ENTRIES
        self._lock = threading.Lock()
        #: [monotonic time of the first failure merged into it, failures], oldest first.
        self._entries: collections.deque[list[Any]] = collections.deque()
        self.total = 0
        self._last_at: float | None = None  # wall clock, for people and metrics
        self._last_from = ""
        self._logged_at: float | None = None

    def record(self, source: str, now: float | None = None) -> None:
        """A connection from ``source`` (its address, as the transport reports it) failed
        authentication. Logs a warning unless one went out in the last window."""
        now = time.monotonic() if now is None else now
        source = source[:MAX_SOURCE_CHARS]
        with self._lock:
            self.total += 1
            self._last_at = time.time()
            self._last_from = source
            if self._entries and now - self._entries[-1][0] < self._spacing:
                self._entries[-1][1] += 1
            else:
                self._entries.append([now, 1])
            self._prune(now)
            warn = self._logged_at is None or now - self._logged_at >= self.window
            if warn:
                self._logged_at = now
                recent = self._count(now - self.window, now)  # once a window: a flood scans nothing
        if not warn:
            log.debug("connection from %s failed authentication", source)
            return
        log.warning(
            "connections to endpoint %s are failing authentication: %d in the last %g s, the last from %s (its "
            "proof does not verify under this endpoint's secret, %s: a peer has another KVTRANSPORT_SECRET, or "
            "none). Next report in %g s at the earliest; the endpoint's stats and metrics count every one",
            self._endpoint,
            recent,
            self.window,
            source or "an unknown address",
            self._secret_source,
            self.window,
        )

    def _prune(self, now: float) -> None:
        while self._entries and (self._entries[0][0] < now - self._keep or len(self._entries) > MAX_ENTRIES):
            self._entries.popleft()

    def _count(self, start: float, end: float) -> int:
        return sum(n for t, n in self._entries if start <= t <= end)

    def recent(self, now: float | None = None) -> int:
        """Failures in the last window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._count(now - self.window, now)

    def seen_around(self, arrived: float, grace: float, now: float | None = None) -> bool:
        """Whether a connection failed authentication within ``grace`` seconds of ``arrived``
        (a monotonic time), before or after it: what a request that arrived then and still
        waits for its peer may be waiting for. ``grace`` should be at most half of ``keep``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._prune(now)
            return self._count(arrived - grace, arrived + grace) > 0

    def describe_recent(self, now: float | None = None) -> str:
        """``"N in the last 60 s, last from ADDR"``, for a failure's reason."""
        now = time.monotonic() if now is None else now
        with self._lock:
            recent, source = self._count(now - self.window, now), self._last_from
        return f"{recent} in the last {self.window:g} s, last from {source or 'an unknown address'}"

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """``{"failures", "recent", "window_s", "last_at", "last_from"}``: the total, the
        count in the last window, its length, the last one's wall-clock time (None before
        any) and source address (docs/metrics.md)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return {
                "failures": self.total,
                "recent": self._count(now - self.window, now),
                "window_s": self.window,
                "last_at": self._last_at,
                "last_from": self._last_from,
            }
