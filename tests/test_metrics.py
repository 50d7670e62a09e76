"""The endpoint's metrics: each finished transfer counted once per side, by driver and peer,
with its bytes, latency and error type; the per-peer table bounded; a staged driver's ring
gauges; the Prometheus collector's exposition of the same figures."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from kvtransport.runtime.endpoint import Connection, Endpoint, State, Timeouts, Transfer
from kvtransport.runtime.metrics import LATENCY_BUCKETS_S, SCHEMA_VERSION, Histogram, Metrics, error_type
from kvtransport.spi.errors import TransferAborted
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import KVPool

FAKE = {"fake": FakeDriver}
FAST = Timeouts(connect=5, bootstrap=5, waiting=5, transfer=5, heartbeat_interval=0.1, heartbeat_timeout=1.0)
ITEM, LAYERS = 512, 2


@contextlib.contextmanager
def pair() -> Iterator[tuple[Endpoint, Endpoint, Connection, Connection]]:
    pools = [KVPool(32, LAYERS, ITEM, 4), KVPool(32, LAYERS, ITEM, 4)]
    eps: list[Endpoint] = []
    try:
        for name, pool in zip(("prefill", "decode"), pools, strict=True):
            eps.append(Endpoint(pool.regions, pool.layout, drivers=FAKE, name=name, timeouts=FAST))
        recv = eps[1].connect(eps[0].address)
        send = eps[0].accept(5)
        yield eps[0], eps[1], send, recv
    finally:
        for ep in eps:
            ep.close()
        for pool in pools:
            pool.close()


def _announced(conn: Connection, tag: str) -> Transfer:
    tx = conn.sender(tag)
    deadline = time.monotonic() + 5
    while tx.state is State.BOOTSTRAPPING:
        assert time.monotonic() < deadline, "the announcement never arrived"
        time.sleep(0.005)
    return tx


def _series(snapshot: dict, role: str) -> dict:  # type: ignore[type-arg]
    (s,) = [s for s in snapshot["drivers"] if s["role"] == role]
    return s


def _settle(ep: Endpoint, role: str, total: int) -> dict:  # type: ignore[type-arg]
    """The snapshot once ``total`` transfers of ``role`` were counted (the I/O thread counts
    them just after the caller saw them end)."""
    deadline = time.monotonic() + 5
    while True:
        snap = ep.metrics.snapshot()
        done = [s for s in snap["drivers"] if s["role"] == role]
        if done and done[0]["succeeded"] + done[0]["failed"] >= total:
            return snap
        assert time.monotonic() < deadline, snap
        time.sleep(0.01)


def test_finished_transfers_are_counted_once_per_side_with_bytes_latency_and_errors() -> None:
    with pair() as (prefill, decode, send, recv):
        for i in range(3):
            rx = recv.expect(f"ok{i}", [i, i + 10])
            tx = _announced(send, f"ok{i}")
            tx.send([i + 1, i + 2])
            assert rx.wait(5) is State.SUCCESS and tx.wait(5) is State.SUCCESS
        rx = recv.expect("gone", [20])
        tx = _announced(send, "gone")
        rx.abort("the caller gave up")
        for t in (rx, tx):
            with pytest.raises(TransferAborted):
                t.wait(5)
        sent = _series(_settle(prefill, "send", 4), "send")
        got = _series(_settle(decode, "recv", 4), "recv")
        per_request = 2 * LAYERS * ITEM
        for s in (sent, got):
            assert (s["driver"], s["succeeded"], s["failed"]) == ("fake", 3, 1), s
            assert s["bytes"] == 3 * per_request, s
            assert s["failures"] == {"TransferAborted": 1}, s
            assert s["latency_s"]["count"] == 4 and s["latency_s"]["sum"] > 0
            assert sum(s["size_bytes"]["counts"]) == 4
        (peer,) = _settle(decode, "recv", 4)["peers"]
        assert (peer["peer"], peer["role"], peer["succeeded"]) == ("prefill", "recv", 3), peer
        snap = decode.metrics.snapshot()
        assert snap["version"] == SCHEMA_VERSION and snap["gauges"]["connections"] == 1


def test_the_per_peer_series_are_bounded_and_what_goes_stays_in_the_driver_totals() -> None:
    class Done:
        state, role, bytes, error, started, created, finished = State.SUCCESS, "send", 100, None, 1.0, 0.5, 1.25

    metrics = Metrics(max_peers=2)
    for peer in ("a", "b", "c", "a"):
        metrics.observe(Done(), "fake", peer)  # type: ignore[arg-type]
    snap = metrics.snapshot()
    assert [p["peer"] for p in snap["peers"]] == ["c", "a"]  # "b" least recently active: gone
    assert snap["drivers"][0]["succeeded"] == 4 and snap["drivers"][0]["bytes"] == 400
    assert snap["drivers"][0]["latency_s"]["sum"] == pytest.approx(4 * 0.25)


def test_histogram_buckets_and_error_types() -> None:
    h = Histogram(LATENCY_BUCKETS_S)
    for v in (0.0, 50e-6, 51e-6, 1.0, 1e9):
        h.observe(v)
    assert h.counts[0] == 2 and h.counts[1] == 1 and h.counts[-1] == 1 and h.count == 5
    assert error_type(TransferAborted("x")) == "TransferAborted"
    assert error_type(ValueError("x")) == "other" and error_type(None) == "other"
    from kvtransport.runtime.fanin import PartialAnnouncement

    # An error class of another module counts as its nearest kvtransport.spi.errors ancestor.
    assert error_type(PartialAnnouncement("x", None)) == "TransferError"  # type: ignore[arg-type]


def test_the_prometheus_collector_exposes_the_same_figures() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvtransport.runtime.prometheus import register

    with pair() as (_, decode, send, recv):
        rx = recv.expect("p", [1, 2])
        _announced(send, "p").send([3, 4])
        assert rx.wait(5) is State.SUCCESS
        _settle(decode, "recv", 1)
        registry = prometheus_client.CollectorRegistry()
        register(decode, registry=registry)
        text = prometheus_client.generate_latest(registry).decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    key = {"endpoint": "decode", "driver": "fake", "role": "recv"}

    def value(name: str, **extra: str) -> float:
        return samples[(name, tuple(sorted({**key, **extra}.items())))]

    assert value("kvtransport_transfers_total", outcome="success") == 1, text
    assert value("kvtransport_transfers_total", outcome="failure") == 0
    assert value("kvtransport_transfer_bytes_total") == 2 * LAYERS * ITEM
    assert value("kvtransport_transfer_seconds_bucket", le="+Inf") == 1
    assert value("kvtransport_transfer_seconds_count") == 1
    assert value("kvtransport_peer_transfer_bytes_total", peer="prefill") == 2 * LAYERS * ITEM
    assert samples[("kvtransport_connections", (("endpoint", "decode"),))] == 1
    assert samples[("kvtransport_transfers_live", (("endpoint", "decode"),))] == 0


def test_a_staged_driver_reports_its_ring() -> None:
    """The staged drivers' ``gauges``: ring slots per direction and those in use (idle: none)."""
    from kvtransport.negotiation.registry import load_driver

    from .conftest import require_engines

    require_engines()
    pool = KVPool(32, LAYERS, ITEM, 0, shared=False)
    ep = Endpoint(pool.regions, pool.layout, drivers={"mooncake-staged": load_driver("mooncake-staged")}, name="s")
    try:
        ring = ep.metrics.snapshot()["gauges"]["drivers"]["mooncake-staged"]
        assert ring["ring_slots"] >= 1 and ring["ring_outbound"] == ring["ring_granted"] == ring["ring_busy"] == 0
    finally:
        ep.close()
        pool.close()
