"""Counters and histograms of an endpoint's transfers, per driver and per peer: what an operator
watches (bytes, transfers, latency, failures by error type) and what a serving engine reports.

Every transfer is counted once, when it reaches a final state, on the endpoint's I/O thread:
its driver, its role (``send``/``recv``), its peer, its bytes, its latency and, if it failed,
its error type. Latency is what each side waits: a sender from its first chunk handed to the
driver (or its creation, if it never sent one) to its end; a receiver from its announcement to
its end (so it includes the time the sender took to start, e.g. prefill's forward).
:meth:`Metrics.snapshot` returns a plain dict with a stable schema
(``SCHEMA_VERSION``, documented in docs/metrics.md) from any thread. Gauges (transfers in
flight, a staged driver's ring slots) are read at snapshot time, not kept, and so is the
endpoint's record of connections that failed authentication (``auth``; runtime.auth_failures).

Bounded: the per-driver series are as many as the drivers; the per-peer series keep the
``max_peers`` most recently active peers (a serving engine's peers come and go for weeks), and
what an evicted peer counted stays in its driver's totals. Error types are class names of
:mod:`kvtransport.spi.errors` (a fixed set), plus one ``other`` bucket for anything else.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtransport.spi import errors as errors_module

if TYPE_CHECKING:
    from kvtransport.runtime.handles import Transfer

SCHEMA_VERSION = 1
#: Upper bounds (seconds) of the latency histogram's buckets; one more bucket holds the rest.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: Upper bounds (bytes) of the transfer-size histogram's buckets: 4 KiB to 4 GiB by 4x.
SIZE_BUCKETS: tuple[float, ...] = tuple(float(4096 * 4**i) for i in range(11))
#: The ``auth`` section of a snapshot without an endpoint's record behind it.
NO_AUTH_FAILURES: Mapping[str, Any] = {"failures": 0, "recent": 0, "window_s": 60.0, "last_at": None, "last_from": ""}
#: Per-peer series kept (the most recently active peers).
DEFAULT_MAX_PEERS = 256
ERROR_TYPES = frozenset(
    name
    for name, value in vars(errors_module).items()
    if isinstance(value, type) and issubclass(value, errors_module.KVTransportError)
)


class Histogram:
    """Counts per bucket (``bounds`` are upper bounds; the last bucket is unbounded), sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def add(self, other: Histogram) -> None:
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.count += other.count
        self.sum += other.sum

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "count": self.count, "sum": self.sum}


@dataclass
class Series:
    """One (driver, role[, peer]) stream of finished transfers."""

    succeeded: int = 0
    failed: int = 0
    bytes: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_S))
    size: Histogram = field(default_factory=lambda: Histogram(SIZE_BUCKETS))

    def observe(self, ok: bool, nbytes: int, seconds: float, error: str) -> None:
        if ok:
            self.succeeded += 1
        else:
            self.failed += 1
            self.failures[error] = self.failures.get(error, 0) + 1
        self.bytes += nbytes
        self.latency.observe(seconds)
        self.size.observe(float(nbytes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "succeeded": self.succeeded,
            "failed": self.failed,
            "bytes": self.bytes,
            "failures": dict(sorted(self.failures.items())),
            "latency_s": self.latency.to_dict(),
            "size_bytes": self.size.to_dict(),
        }


def error_type(error: BaseException | None) -> str:
    """The class name of the error's nearest ancestor in :mod:`kvtransport.spi.errors` (a driver's
    own subclass of ``EngineError`` counts as ``EngineError``), else ``other``."""
    for cls in type(error).__mro__ if error is not None else ():
        if cls.__name__ in ERROR_TYPES and getattr(errors_module, cls.__name__, None) is cls:
            return str(cls.__name__)
    return "other"


class Metrics:
    """An endpoint's transfer counters; ``observe`` on the I/O thread, ``snapshot`` anywhere."""

    def __init__(
        self,
        max_peers: int = DEFAULT_MAX_PEERS,
        gauges: Callable[[], Mapping[str, Any]] | None = None,
        auth: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.max_peers = max_peers
        self._lock = threading.Lock()
        self._drivers: dict[tuple[str, str], Series] = {}
        self._peers: collections.OrderedDict[tuple[str, str, str], Series] = collections.OrderedDict()
        self._gauges = gauges
        #: Transfers' moves from a failed lane to another (``runtime.failover``), by the two
        #: drivers (bounded by the installed drivers' pairs).
        self._failovers: dict[tuple[str, str], int] = {}
        #: Failed lanes that came back from quarantine and passed their probe, by driver.
        self._lanes_back: dict[str, int] = {}
        #: The endpoint's record of connections that failed authentication (auth_failures.py).
        self._auth = auth

    def observe(self, transfer: Transfer, driver: str, peer: str) -> None:
        """Count ``transfer``, which just reached a final state."""
        from kvtransport.runtime.handles import State

        ok = transfer.state is State.SUCCESS
        begin = (transfer.started or transfer.created) if transfer.role == "send" else transfer.created
        seconds = max(0.0, (transfer.finished or begin) - begin)
        error = "" if ok else error_type(transfer.error)
        role = transfer.role
        with self._lock:
            self._drivers.setdefault((driver, role), Series()).observe(ok, transfer.bytes, seconds, error)
            key = (peer, driver, role)
            series = self._peers.pop(key, None) or Series()
            series.observe(ok, transfer.bytes, seconds, error)
            self._peers[key] = series  # the newest at the end; the least recently active go first
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)

    def failed_over(self, old: str, new: str) -> None:
        """A connection's lane ``old`` failed and its transfers went over ``new``."""
        with self._lock:
            self._failovers[(old, new)] = self._failovers.get((old, new), 0) + 1

    def lane_back(self, driver: str) -> None:
        """A connection's lane of ``driver`` came back from quarantine and passed its probe."""
        with self._lock:
            self._lanes_back[driver] = self._lanes_back.get(driver, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """``{"version", "drivers": [...], "peers": [...], "gauges": {...}, "auth": {...}}``: each
        series with its labels (``driver``, ``role``, and ``peer`` for the per-peer ones), and
        the connections that failed authentication (``auth``: total, in the last window, the
        last one's time and source address)."""
        with self._lock:
            drivers = [{"driver": d, "role": r, **s.to_dict()} for (d, r), s in sorted(self._drivers.items())]
            peers = [{"peer": p, "driver": d, "role": r, **s.to_dict()} for (p, d, r), s in self._peers.items()]
            failovers = [{"from": a, "to": b, "count": n} for (a, b), n in sorted(self._failovers.items())]
            lanes_back = [{"driver": d, "count": n} for d, n in sorted(self._lanes_back.items())]
        gauges = dict(self._gauges()) if self._gauges is not None else {}
        auth = dict(self._auth()) if self._auth is not None else dict(NO_AUTH_FAILURES)
        return {
            "version": SCHEMA_VERSION,
            "drivers": drivers,
            "peers": peers,
            "gauges": gauges,
            "auth": auth,
            "failovers": failovers,
            "lanes_back": lanes_back,
        }
