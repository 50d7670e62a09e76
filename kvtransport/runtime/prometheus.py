"""kvtransport's metrics as a Prometheus collector (``pip install 'kvtransport[prometheus]'``).

:func:`register` adds a collector over one or more endpoints' :class:`~kvtransport.runtime.metrics.Metrics`
to a ``prometheus_client`` registry (the default one unless given); each scrape reads a fresh
snapshot, so nothing is copied between scrapes. Metric names and labels: docs/metrics.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtransport.spi.errors import ConfigError

PREFIX = "kvtransport"
_NAME = re.compile(r"[^a-z0-9_]")


def _client() -> Any:
    try:
        import prometheus_client.core as core
    except ImportError as exc:
        raise ConfigError(
            "kvtransport's Prometheus collector needs prometheus-client: pip install 'kvtransport[prometheus]'"
        ) from exc
    return core


class Collector:
    """Yields the metric families of each snapshot ``sources`` return (one per endpoint); an
    ``endpoint`` label tells endpoints of one process apart."""

    def __init__(self, sources: Sequence[tuple[str, Callable[[], dict[str, Any]]]]) -> None:
        self._core = _client()
        self._sources = list(sources)

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families depend on what the endpoints have seen

    def collect(self) -> Iterator[Any]:
        core = self._core
        labels = ["endpoint", "driver", "role"]
        transfers = core.CounterMetricFamily(
            f"{PREFIX}_transfers", "Finished transfers by outcome", labels=[*labels, "outcome"]
        )
        nbytes = core.CounterMetricFamily(f"{PREFIX}_transfer_bytes", "Bytes of finished transfers", labels=labels)
        failures = core.CounterMetricFamily(
            f"{PREFIX}_transfer_failures", "Failed transfers by error type", labels=[*labels, "error"]
        )
        latency = core.HistogramMetricFamily(
            f"{PREFIX}_transfer_seconds", "What a side waited for a transfer (docs/metrics.md)", labels=labels
        )
        size = core.HistogramMetricFamily(f"{PREFIX}_transfer_size_bytes", "Bytes per transfer", labels=labels)
        peer_bytes = core.CounterMetricFamily(
            f"{PREFIX}_peer_transfer_bytes", "Bytes of finished transfers per peer", labels=[*labels, "peer"]
        )
        peer_failures = core.CounterMetricFamily(
            f"{PREFIX}_peer_transfer_failures", "Failed transfers per peer", labels=[*labels, "peer"]
        )
        connections = core.GaugeMetricFamily(f"{PREFIX}_connections", "Live connections", labels=["endpoint"])
        live = core.GaugeMetricFamily(f"{PREFIX}_transfers_live", "Transfers not finished yet", labels=["endpoint"])
        # No source-address label: strangers choose their addresses, and every one would be a
        # series of its own. The last source is in the snapshot and the log.
        auth_failures = core.CounterMetricFamily(
            f"{PREFIX}_auth_failures",
            "Connections to the endpoint that failed authentication (another secret, or none)",
            labels=["endpoint"],
        )
        auth_last = core.GaugeMetricFamily(
            f"{PREFIX}_auth_failure_last_timestamp_seconds",
            "Unix time of the last connection that failed authentication (absent before any)",
            labels=["endpoint"],
        )
        failovers = core.CounterMetricFamily(
            f"{PREFIX}_failovers",
            "Connections' lanes that failed, their transfers sent again over another (runtime.failover)",
            labels=["endpoint", "from_driver", "to_driver"],
        )
        lanes_back = core.CounterMetricFamily(
            f"{PREFIX}_lanes_back",
            "Failed lanes that came back from quarantine and passed their probe (runtime.failover)",
            labels=["endpoint", "driver"],
        )
        driver_gauges: dict[str, Any] = {}
        for endpoint, snapshot in self._sources:
            snap = snapshot()
            for s in snap["drivers"]:
                key = [endpoint, s["driver"], s["role"]]
                transfers.add_metric([*key, "success"], s["succeeded"])
                transfers.add_metric([*key, "failure"], s["failed"])
                nbytes.add_metric(key, s["bytes"])
                for error, n in s["failures"].items():
                    failures.add_metric([*key, error], n)
                latency.add_metric(key, _buckets(s["latency_s"]), s["latency_s"]["sum"])
                size.add_metric(key, _buckets(s["size_bytes"]), s["size_bytes"]["sum"])
            for s in snap["peers"]:
                key = [endpoint, s["driver"], s["role"], s["peer"]]
                peer_bytes.add_metric(key, s["bytes"])
                peer_failures.add_metric(key, s["failed"])
            g = snap["gauges"]
            connections.add_metric([endpoint], g.get("connections", 0))
            live.add_metric([endpoint], g.get("transfers", 0))
            auth = snap.get("auth", {})
            auth_failures.add_metric([endpoint], auth.get("failures", 0))
            if auth.get("last_at") is not None:
                auth_last.add_metric([endpoint], auth["last_at"])
            for f in snap.get("failovers", []):
                failovers.add_metric([endpoint, f["from"], f["to"]], f["count"])
            for b in snap.get("lanes_back", []):
                lanes_back.add_metric([endpoint, b["driver"]], b["count"])
            for driver, values in g.get("drivers", {}).items():
                for what, value in values.items():
                    name = f"{PREFIX}_driver_{_NAME.sub('_', what.lower())}"
                    family = driver_gauges.get(name)
                    if family is None:
                        family = driver_gauges[name] = core.GaugeMetricFamily(
                            name, f"A driver's {what} now (its gauges())", labels=["endpoint", "driver"]
                        )
                    family.add_metric([endpoint, driver], value)
        yield from (transfers, nbytes, failures, latency, size, peer_bytes, peer_failures, connections, live)
        yield from (auth_failures, auth_last, failovers, lanes_back)
        yield from driver_gauges.values()


def _buckets(h: dict[str, Any]) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs, ``+Inf`` last, as Prometheus histograms count."""
    from prometheus_client.utils import floatToGoString

    out, total = [], 0
    for bound, n in zip([*h["bounds"], float("inf")], h["counts"], strict=True):
        total += n
        out.append((str(floatToGoString(bound)), float(total)))  # type: ignore[no-untyped-call]
    return out


def register(*endpoints: Any, registry: Any = None) -> Collector:
    """Expose ``endpoints`` (each an :class:`~kvtransport.runtime.endpoint.Endpoint`) on ``registry``
    (``prometheus_client.REGISTRY`` by default); returns the collector (``registry.unregister``
    it when the endpoints close)."""
    core = _client()
    collector = Collector([(ep.name, ep.metrics.snapshot) for ep in endpoints])
    (registry if registry is not None else core.REGISTRY).register(collector)
    return collector
