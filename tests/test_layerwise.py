"""Layer-wise sends through the endpoint (two endpoints in this process, the fake drivers):
groups marked in any order and from readiness signals, short requests in one batch, layer-wise
and plain chunks of one transfer, aborts and timeouts between groups, groups that merge when
the link falls behind, and the caller's mistakes. The real engines run the same sends in the
conformance suite (``kvtransport.testing.conformance``, ``test_layerwise_*``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvtransport.runtime.endpoint import State, Timeouts
from kvtransport.runtime.layer_groups import LayerwisePolicy
from kvtransport.runtime.readiness import ReadinessWatcher
from kvtransport.spi.errors import ConfigError, KVTransportError, TransferAborted, TransferTimeout
from kvtransport.testing.fake import FakeDriver, FakeTwoSided
from tests.test_endpoint import FAST, endpoints, ready

LAYERS = 4  # 8 KV regions: every layer's K, then every layer's V
EVERY_LAYER = LayerwisePolicy(min_tokens=0, first_group=1, adaptive=False)


def _regions_of(layer: int) -> list[int]:
    return [layer, layer + LAYERS]


@pytest.mark.parametrize("driver", [FakeDriver, FakeTwoSided], ids=["one-sided", "two-sided"])
def test_groups_in_any_order_land_byte_exact_with_aux(driver: Any) -> None:
    with endpoints(layers=2 * LAYERS, drivers={"fake": driver}) as (_, _, send_conn, recv_conn, a, b):
        src, dst = [1, 2, 3, 9, 10], [20, 21, 22, 40, 41]
        b.poison(dst)
        r = recv_conn.expect("lw", dst, aux=2)
        t = send_conn.sender("lw")
        ready(t)
        stream = t.send_layerwise(src, aux=1, policy=EVERY_LAYER)
        for layer in (2, 0, 3):
            stream.layer_ready(layer)
        assert [g.layers for g in stream.groups] == [(2,), (0,), (3,)]
        # Layers posted so far have landed; the receiver still waits for the last one.
        time.sleep(0.1)
        assert r.state is not State.SUCCESS and t.state is State.TRANSFERRING
        assert b.page_digests(dst, _regions_of(2)) == a.page_digests(src, _regions_of(2))
        assert b.page_digests(dst, _regions_of(1)) != a.page_digests(src, _regions_of(1))
        stream.layer_ready(1)
        assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS
        assert stream.complete and len(stream.groups) == LAYERS
        assert b.page_digests(dst) == a.page_digests(src)
        assert b.aux_digest(2) == a.aux_digest(1)


def test_a_short_request_goes_in_one_batch_once_every_layer_is_ready() -> None:
    with endpoints(layers=2 * LAYERS) as (_, _, send_conn, recv_conn, a, b):
        r = recv_conn.expect("short", [5, 6])
        t = send_conn.sender("short")
        ready(t)
        # 2 pages of 16 tokens: under min_tokens.
        stream = t.send_layerwise([7, 8], policy=LayerwisePolicy(min_tokens=64))
        assert stream.whole
        for layer in range(LAYERS - 1):
            stream.layer_ready(layer)
        assert stream.groups == [] and t.state is State.WAITING_FOR_INPUT
        stream.layer_ready(LAYERS - 1)
        assert [g.layers for g in stream.groups] == [tuple(range(LAYERS))]
        assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS
        assert b.page_digests([5, 6]) == a.page_digests([7, 8])


def test_layerwise_and_plain_chunks_of_one_transfer() -> None:
    """A layer-wise chunk still posting when the plain last chunk is sent: the transfer's
    last part is the stream's last group, and "done" waits for it."""
    with endpoints(layers=2 * LAYERS) as (_, _, send_conn, recv_conn, a, b):
        dst = [30, 31, 32, 33, 34, 35]
        r = recv_conn.expect("mixed", dst)
        t = send_conn.sender("mixed")
        ready(t)
        stream = t.send_layerwise([1, 2, 3], last=False, policy=EVERY_LAYER)
        stream.layers_ready(range(LAYERS - 1))
        t.send([4, 5, 6], last=True)
        time.sleep(0.1)
        assert t.state is State.TRANSFERRING and r.state is not State.SUCCESS
        with pytest.raises(KVTransportError, match="last chunk was already sent"):
            t.send([7], last=True)
        stream.layer_ready(LAYERS - 1)
        assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS
        assert b.page_digests(dst) == a.page_digests([1, 2, 3, 4, 5, 6])
        # ... and the other way round: plain chunks first, the layer-wise one last.
        dst2 = [50, 51, 52, 53]
        r2 = recv_conn.expect("mixed2", dst2)
        t2 = send_conn.sender("mixed2")
        ready(t2)
        t2.send([10, 11], last=False)
        stream2 = t2.send_layerwise([12, 13], policy=EVERY_LAYER)
        stream2.layers_ready(reversed(range(LAYERS)))
        assert t2.wait(5) is State.SUCCESS and r2.wait(5) is State.SUCCESS
        assert b.page_digests(dst2) == a.page_digests([10, 11, 12, 13])


class Event:
    """Stands in for a CUDA event: ``query()`` is True once it completed."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


def test_layers_marked_after_a_signal_go_when_it_fires() -> None:
    with endpoints(layers=2 * LAYERS) as (prefill, _, send_conn, recv_conn, a, b):
        r = recv_conn.expect("ev", [3, 4])
        t = send_conn.sender("ev")
        ready(t)
        stream = t.send_layerwise([5, 6], policy=EVERY_LAYER)
        events = [Event() for _ in range(LAYERS)]
        for layer, event in enumerate(events):
            stream.layer_ready(layer, after=event)
        flag = [False]
        assert stream.groups == []
        events[2].done.set()
        deadline = time.monotonic() + 5
        while not stream.groups and time.monotonic() < deadline:
            time.sleep(0.001)
        assert [g.layers for g in stream.groups] == [(2,)], "the signal that fired first goes first"
        for event in events:
            event.done.set()
        assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS
        assert b.page_digests([3, 4]) == a.page_digests([5, 6])
        # A plain callable works too, and anything else is refused at once.
        r2 = recv_conn.expect("ev2", [8])
        t2 = send_conn.sender("ev2")
        ready(t2)
        s2 = t2.send_layerwise([9], policy=LayerwisePolicy(min_tokens=0, first_group=LAYERS))
        with pytest.raises(KVTransportError, match="query"):
            s2.layer_ready(0, after=42)
        s2.layers_ready(range(LAYERS), after=lambda: flag[0])
        time.sleep(0.05)
        assert s2.groups == []
        flag[0] = True
        assert t2.wait(5) is State.SUCCESS and r2.wait(5) is State.SUCCESS
        assert prefill.readiness().pending == 0


def test_an_abort_between_groups_posts_nothing_more() -> None:
    with endpoints(layers=2 * LAYERS) as (prefill, _, send_conn, recv_conn, _, b):
        dst = [10, 11, 12]
        b.poison(dst)
        later = b.page_digests(dst, _regions_of(1) + _regions_of(2) + _regions_of(3))
        r = recv_conn.expect("ab", dst)
        t = send_conn.sender("ab")
        ready(t)
        stream = t.send_layerwise([1, 2, 3], policy=EVERY_LAYER)
        stream.layer_ready(0)
        pending = Event()
        stream.layer_ready(3, after=pending)  # waits for its signal when the abort comes
        t.abort("preempted between layers")
        with pytest.raises(TransferAborted, match="preempted"):
            stream.layer_ready(1)
        pending.done.set()
        with pytest.raises(TransferAborted):
            t.wait(5)
        with pytest.raises(TransferAborted):
            r.wait(5)
        assert r.drained.wait(5)
        deadline = time.monotonic() + 5
        while prefill.readiness().pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert prefill.readiness().pending == 0, "the signal's watch ends with its transfer"
        assert [g.layers for g in stream.groups] == [(0,)]
        time.sleep(0.05)
        assert b.page_digests(dst, _regions_of(1) + _regions_of(2) + _regions_of(3)) == later


def test_a_sender_that_never_marks_its_last_layer_times_out() -> None:
    timeouts = Timeouts(connect=5, bootstrap=5, waiting=5, transfer=0.5, heartbeat_interval=0.1, heartbeat_timeout=1)
    with endpoints(timeouts=timeouts, layers=2 * LAYERS) as (_, _, send_conn, recv_conn, _, _):
        r = recv_conn.expect("stuck", [1, 2])
        t = send_conn.sender("stuck")
        ready(t)
        stream = t.send_layerwise([3, 4], policy=EVERY_LAYER)
        stream.layers_ready(range(LAYERS - 1))
        with pytest.raises(TransferTimeout):
            t.wait(5)
        with pytest.raises(KVTransportError):
            r.wait(5)
        with pytest.raises(TransferTimeout):
            stream.layer_ready(LAYERS - 1)


@pytest.mark.parametrize("delay", [0.0, 0.08])
def test_groups_merge_only_when_the_link_falls_behind(delay: float) -> None:
    """Layers marked every 20 ms: a link that keeps up gets every layer as a group of its own;
    one whose batches take 80 ms each gets fewer, larger groups as earlier ones pile up."""
    layers = 8
    with endpoints({"fake.delay": str(delay)}, layers=2 * layers) as (_, _, send_conn, recv_conn, a, b):
        r = recv_conn.expect("merge", [1, 2, 3, 4])
        t = send_conn.sender("merge")
        ready(t)
        stream = t.send_layerwise([5, 6, 7, 8], policy=LayerwisePolicy(min_tokens=0, first_group=1))
        for layer in range(layers):
            time.sleep(0.02)
            stream.layer_ready(layer)
        assert t.wait(10) is State.SUCCESS and r.wait(10) is State.SUCCESS
        assert b.page_digests([1, 2, 3, 4]) == a.page_digests([5, 6, 7, 8])
        sizes = [len(g.layers) for g in stream.groups]
        assert sum(sizes) == layers
        if delay:
            assert len(sizes) < layers and max(sizes) > 1, sizes
        else:
            assert sizes == [1] * layers, sizes


def test_the_callers_mistakes_are_refused_before_anything_moves() -> None:
    with endpoints(layers=2 * LAYERS) as (_, _, send_conn, recv_conn, _, _):
        r = recv_conn.expect("bad", [1, 2])
        with pytest.raises(KVTransportError, match="receiving"):
            r.send_layerwise([1, 2])
        t = send_conn.sender("bad")
        early = send_conn.sender("early")  # nothing announced for it
        with pytest.raises(KVTransportError, match="not announced"):
            early.send_layerwise([1])
        ready(t)
        for pages in ([1, 2, 3], [1, 10_000]):
            with pytest.raises(KVTransportError):
                t.send_layerwise(pages)
        with pytest.raises(ConfigError, match="region_layers"):
            t.send_layerwise([3, 4], region_layers=[0, 1])
        assert t.state is State.WAITING_FOR_INPUT and t.sent_pages == 0
        stream = t.send_layerwise([3, 4], policy=EVERY_LAYER)
        for bad in (-1, LAYERS, "1"):
            with pytest.raises(ConfigError):
                stream.layer_ready(bad)  # type: ignore[arg-type]
        stream.layer_ready(0)
        with pytest.raises(ConfigError, match="already"):
            stream.layer_ready(0)
        with pytest.raises(KVTransportError, match="last chunk was already sent"):
            t.send_layerwise([5, 6])
        stream.layers_ready(range(1, LAYERS))
        assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS


def test_the_readiness_watcher_is_bounded_and_stops_with_its_endpoint() -> None:
    watcher = ReadinessWatcher("test", max_watches=2)
    fired: list[int] = []
    watcher.watch(lambda: True, lambda: fired.append(1), lambda: False)
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.001)
    assert fired == [1]
    watcher.watch(lambda: False, lambda: fired.append(2), lambda: False)
    watcher.watch(lambda: False, lambda: fired.append(3), lambda: False)
    with pytest.raises(KVTransportError, match="at most 2"):
        watcher.watch(lambda: False, lambda: None, lambda: False)
    thread = watcher._thread
    assert thread is not None and thread.is_alive()
    watcher.close()
    assert not thread.is_alive() and fired == [1]
    with pytest.raises(KVTransportError, match="closed"):
        watcher.watch(lambda: True, lambda: None, lambda: False)
    with endpoints(layers=2 * LAYERS, timeouts=FAST) as (prefill, *_):
        thread = None
        w = prefill.readiness()
        w.watch(lambda: False, lambda: None, lambda: False)
        thread = w._thread
    assert thread is not None and not thread.is_alive(), "the endpoint's close stops its watcher"


def test_aborting_the_tag_on_the_connection_refuses_further_groups_at_once() -> None:
    with endpoints(layers=2 * LAYERS) as (_, _, send_conn, recv_conn, _, _):
        r = recv_conn.expect("by-tag", [1, 2])
        t = send_conn.sender("by-tag")
        ready(t)
        stream = t.send_layerwise([3, 4], policy=EVERY_LAYER)
        stream.layer_ready(0)
        send_conn.abort("by-tag", "the request was cancelled")
        with pytest.raises(TransferAborted, match="cancelled"):
            stream.layer_ready(1)
        with pytest.raises(TransferAborted):
            r.wait(5)
        assert len(stream.groups) == 1


def test_layers_marked_in_one_call_leave_in_one_batch() -> None:
    with endpoints(layers=2 * LAYERS) as (_, _, send_conn, recv_conn, a, b):
        r = recv_conn.expect("together", [1, 2])
        t = send_conn.sender("together")
        ready(t)
        stream = t.send_layerwise([3, 4], policy=EVERY_LAYER)
        stream.layer_ready(2)
        stream.layers_ready([0, 3, 1])
        assert [g.layers for g in stream.groups] == [(2,), (0, 3, 1)]
        assert t.wait(5) is State.SUCCESS and r.wait(5) is State.SUCCESS
        assert b.page_digests([1, 2]) == a.page_digests([3, 4])
