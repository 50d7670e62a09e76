"""The staging pipeline: chunking (hypothesis), ring configuration, and the pipeline itself.

In-process tests wire two real pipelines together with a memcpy link and an in-order notice
courier, to drive the credit logic hard (10,000 transfers, a slow receiver, aborts,
disconnects, hostile notices). The two-process tests run the same pipeline inside
``mooncake-staged`` (real Mooncake) and ``nixl-staged`` (real NIXL/UCX), with a ring much
smaller than the transfers, and check the bytes and that every ring slot comes back."""

from __future__ import annotations

import ctypes
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.negotiation.registry import load_driver
from kvtransport.runtime.endpoint import Endpoint, State, Timeouts, Transfer
from kvtransport.spi.errors import ConfigError, DriverError, EngineError, PeerLost, ProtocolError
from kvtransport.spi.inbound import FEW_PIECES
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs, plan
from kvtransport.staging import MemcpyCopyEngine, RingConfig, StagingPipeline, chunk_runs
from kvtransport.staging import pipeline as pipeline_module
from kvtransport.staging import receiving as receiving_module
from kvtransport.staging.config import MAX_SLOTS
from kvtransport.staging.copy import as_list
from kvtransport.staging.notices import (
    MAX_HOLD_MS,
    ChunkNotice,
    Grant,
    Lend,
    Release,
    Revoke,
    Want,
    decode_notice,
    encode_chunk,
    encode_grant,
    encode_lend,
    encode_release,
    encode_revoke,
    encode_want,
)
from kvtransport.staging.pipeline import LEND_MAX_SLOTS
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import PeerProcess

from .conftest import require_engines

# --- chunking ----------------------------------------------------------------------------------


@st.composite
def runs_and_chunk(draw: st.DrawFn) -> tuple[Runs, int]:
    n = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    src = np.cumsum([0, *lengths[:-1]], dtype=np.uint64) + np.uint64(1 << 20)
    dst = np.cumsum([0, *lengths[:-1]], dtype=np.uint64)[::-1].copy() + np.uint64(1 << 30)
    how = draw(st.sampled_from(["arrays", "signed", "lists"]))
    if how == "lists":  # as a small plan makes them: lists, arrays only when asked for
        return Runs.of_lists(src.tolist(), dst.tolist(), list(lengths)), draw(st.integers(1, 9000))
    if how == "signed":  # a Runs built by hand may hold signed arrays; chunks are uint64 all the same
        src, dst = src.astype(np.int64), dst.astype(np.int64)
    return Runs(src, dst, np.array(lengths, dtype=np.uint64)), draw(st.integers(1, 9000))


@settings(max_examples=300, deadline=None)
@given(runs_and_chunk())
def test_chunks_cover_every_byte_once_in_order_and_fit_their_slot(case: tuple[Runs, int]) -> None:
    runs, size = case
    chunks = chunk_runs(runs, size)
    assert sum(c.nbytes for c in chunks) == runs.total_bytes
    assert all(0 < c.nbytes <= size for c in chunks)
    for c in chunks:  # uint64 arrays, or for one chunk of a few runs lists of ints in uint64's range
        for a in (c.src, c.dst, c.length, c.offset):
            if isinstance(a, list):
                assert runs.listed and len(chunks) == 1 and len(a) <= FEW_PIECES
                assert all(type(x) is int and 0 <= x < 1 << 64 for x in a)
            else:
                assert a.dtype == np.uint64
    for c in chunks:  # pieces packed back to back from offset 0
        assert c.offset[0] == 0
        assert np.array_equal(np.asarray(c.offset[1:]), np.cumsum(np.asarray(c.length))[:-1])
    # Rebuild each run's (src, dst) byte mapping from the pieces.
    pieces = [(int(s), int(d), int(n)) for c in chunks for s, d, n in zip(c.src, c.dst, c.length, strict=True)]
    expected = []
    for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        expected.append((s, d, n))
    merged: list[tuple[int, int, int]] = []
    for s, d, n in pieces:
        if merged and merged[-1][0] + merged[-1][2] == s and merged[-1][1] + merged[-1][2] == d:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((s, d, n))
    assert merged == expected


def test_ring_config_from_env_and_options() -> None:
    assert RingConfig.from_env({}).slots == (256 << 20) // (8 << 20) // 2
    env = {"KVTRANSPORT_STAGING_RING_BYTES": str(64 << 20), "KVTRANSPORT_STAGING_CHUNK_BYTES": str(1 << 20)}
    assert RingConfig.from_env(env).slots == 32
    assert RingConfig.from_env(env, {"staging.chunk_bytes": str(4 << 20)}).slots == 8
    with pytest.raises(ConfigError, match="at least one chunk each way"):
        RingConfig.from_env({"KVTRANSPORT_STAGING_RING_BYTES": str(1 << 20)})
    with pytest.raises(ConfigError, match="not a number"):
        RingConfig.from_env({"KVTRANSPORT_STAGING_CHUNK_BYTES": "8M"})


# --- notices ---------------------------------------------------------------------------------

SLOTS = 16
packable_ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.integers(-3, SLOTS + 3), st.integers(-3, MAX_HOLD_MS + 3)
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, SLOTS - 1), max_size=SLOTS),
    st.integers(0, MAX_HOLD_MS),
    st.integers(1, SLOTS),
)
def test_credit_notices_decode_to_what_was_encoded(slots: list[int], hold: int, n: int) -> None:
    assert decode_notice(encode_want(n), SLOTS) == Want(n)
    assert decode_notice(encode_grant(slots), SLOTS) == Grant(tuple(slots))
    assert decode_notice(encode_release(slots), SLOTS) == Release(tuple(slots))
    assert decode_notice(encode_revoke(slots), SLOTS) == Revoke(tuple(slots))
    assert decode_notice(encode_lend(slots, hold), SLOTS) == Lend(tuple(slots), hold)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, SLOTS - 1),
    st.lists(st.tuples(*[st.integers(0, 2**64 - 1)] * 3), min_size=1, max_size=3 * FEW_PIECES),
    st.booleans(),
)
def test_a_chunk_notice_decodes_to_what_was_encoded_as_lists_when_few(
    slot: int, pieces: list[tuple[int, int, int]], as_arrays: bool
) -> None:
    """Lists or arrays in, the same uint64 values out: lists for at most ``FEW_PIECES``
    pieces (a small chunk's, handled without numpy downstream), arrays for more."""
    dst, length, offset = (list(x) for x in zip(*pieces, strict=True))
    given_ = [np.array(x, dtype=np.uint64) for x in (dst, length, offset)] if as_arrays else [dst, length, offset]
    notice = decode_notice(encode_chunk(slot, *given_), SLOTS)
    assert isinstance(notice, ChunkNotice) and notice.slot == slot
    for got, want in zip((notice.dst, notice.length, notice.offset), (dst, length, offset), strict=True):
        if len(pieces) <= FEW_PIECES:
            assert isinstance(got, list) and got == want
        else:
            assert isinstance(got, np.ndarray) and got.dtype == np.uint64 and got.tolist() == want


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "slots": st.one_of(
                st.lists(st.one_of(packable_ints, st.text(max_size=2), st.none(), st.booleans()), max_size=6),
                packable_ints,
                st.none(),
            ),
            "hold_ms": st.one_of(packable_ints, st.floats(), st.text(max_size=2), st.none(), st.booleans()),
        }
    )
)
def test_a_lend_is_decoded_only_with_slots_of_the_ring_and_a_bounded_hold(doc: dict[str, Any]) -> None:
    slots, hold = doc["slots"], doc["hold_ms"]
    valid = (
        isinstance(slots, list)
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < SLOTS for x in slots)
        and isinstance(hold, int)
        and not isinstance(hold, bool)
        and 0 <= hold <= MAX_HOLD_MS
    )
    data = msgpack.packb({"op": "lend", **doc})
    if valid:
        assert decode_notice(data, SLOTS) == Lend(tuple(slots), hold)
    else:
        with pytest.raises(ProtocolError, match="lend"):
            decode_notice(data, SLOTS)


# --- two pipelines in one process ------------------------------------------------------------


class Courier:
    """Delivers notices in order on one thread, like an endpoint's I/O thread."""

    def __init__(self) -> None:
        self.q: queue.Queue[tuple[Callable[[str, bytes], None], str, bytes] | None] = queue.Queue()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            fn, peer, data = item
            try:
                fn(peer, data)
            except Exception as exc:  # noqa: BLE001 - collected for the test
                self.errors.append(exc)
            finally:
                self.q.task_done()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(5)


class MemcpyLink:
    """A host "driver" for in-process tests: the write happens at post time."""

    def __init__(self, fail_after: int = -1) -> None:
        self.posted = 0
        self.fail_after = fail_after

    def post(self, local: int, remote: int, length: int) -> int:
        self.posted += 1
        if 0 <= self.fail_after < self.posted:
            raise EngineError("injected wire failure")
        ctypes.memmove(remote, local, length)
        return self.posted

    def check(self, token: int) -> bool:
        return True


class Side:
    def __init__(self, name: str, pages: int, item: int, config: RingConfig, delay: float = 0.0) -> None:
        self.pool = KVPool(pages, 2, item, 0, shared=False)
        self.ring = np.zeros(config.ring_bytes, dtype=np.uint8)
        self.notify: Callable[[str, bytes], None] = lambda peer, data: None
        self.pipe = StagingPipeline(
            name,
            int(self.ring.ctypes.data),
            config,
            MemcpyCopyEngine(),
            lambda peer, data: self.notify(peer, data),
            self.pool.regions,
            scatter_delay=delay,
        )

    @property
    def regions(self) -> RegionSet:
        return self.pool.regions


@pytest.fixture
def pair_factory() -> Iterator[Callable[..., tuple[Side, Side, Courier, MemcpyLink]]]:
    made: list[tuple[Side, Side, Courier]] = []

    def make(
        pages: int = 64,
        item: int = 4096,
        ring: int = 64 << 10,
        chunk: int = 8 << 10,
        delay: float = 0.0,
        fail_after: int = -1,
    ) -> tuple[Side, Side, Courier, MemcpyLink]:
        config = RingConfig(ring, chunk)
        a, b = Side("a", pages, item, config), Side("b", pages, item, config, delay)
        courier = Courier()
        a.notify = lambda peer, data: courier.q.put((b.pipe.on_notice, "a", data))
        b.notify = lambda peer, data: courier.q.put((a.pipe.on_notice, "b", data))
        link = MemcpyLink(fail_after)
        a.pipe.connect("b", b.pipe.describe(), link)
        b.pipe.connect("a", a.pipe.describe(), MemcpyLink())
        a.pool.fill(1)
        made.append((a, b, courier))
        return a, b, courier, link

    yield make
    for a, b, courier in made:
        a.pipe.close()
        b.pipe.close()
        courier.close()
        a.pool.close()
        b.pool.close()


def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def _finish(a: Side, b: Side, handles: list[int], courier: Courier) -> None:
    """Like the endpoint: the receiver looks at its inbound work only after every notice sent
    before the batches completed has been delivered (the endpoint's "done" follows them)."""
    for h in handles:
        _wait(lambda h=h: a.pipe.poll(h))  # type: ignore[misc]
    courier.q.join()
    _wait(lambda: b.pipe.inbound_idle("a"))


def _quiet(a: Side, b: Side) -> None:
    _wait(lambda: a.pipe.usage().total == 0 and b.pipe.usage().total == 0)


def test_ten_thousand_transfers_leave_no_slot_behind(pair_factory: Any) -> None:
    a, b, courier, _ = pair_factory(pages=64, item=1024, ring=32 << 10, chunk=4 << 10)
    rng = np.random.default_rng(5)
    handles: list[int] = []
    for i in range(10_000):
        n = int(rng.integers(1, 4))
        src = rng.choice(64, n, replace=False)
        dst = rng.choice(64, n, replace=False)
        handles.append(a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, src, dst)))
        if len(handles) == 200:
            _finish(a, b, handles, courier)
            handles = []
        if i == 9_999:
            _finish(a, b, handles, courier)
            assert b.pool.page_digests(dst.tolist()) == a.pool.page_digests(src.tolist())
    _quiet(a, b)
    assert b.pipe.peak_inbound <= b.pipe.config.slots
    assert not courier.errors


def test_transfer_larger_than_the_ring_streams_through_it(pair_factory: Any) -> None:
    a, b, courier, _ = pair_factory(pages=64, item=4096, ring=32 << 10, chunk=4 << 10)  # 4 slots each way
    src, dst = list(range(64)), list(range(63, -1, -1))
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, src, dst))  # 512 KiB through 16 KiB
    _finish(a, b, [h], courier)
    assert b.pool.page_digests(dst) == a.pool.page_digests(src)
    _quiet(a, b)


def test_slow_receiver_holds_the_sender_by_credits(pair_factory: Any) -> None:
    a, b, courier, link = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10, delay=0.01)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(32)), list(range(32))))
    time.sleep(0.1)
    # After 0.1 s a receiver scattering one chunk per 10 ms has taken about 10 chunks, and the
    # sender may only be ahead of it by the receiver's 4 slots.
    assert link.posted <= 4 + 0.1 / 0.01 + 3
    assert b.pipe.usage().granted + b.pipe.usage().busy <= 4
    _finish(a, b, [h], courier)
    assert b.pipe.peak_inbound == 4
    assert b.pool.page_digests(list(range(32))) == a.pool.page_digests(list(range(32)))
    _quiet(a, b)


def test_abort_mid_stream_returns_every_slot(pair_factory: Any) -> None:
    a, b, _, _ = pair_factory(pages=64, item=4096, ring=32 << 10, chunk=4 << 10, delay=0.005)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(64)), list(range(64))))
    time.sleep(0.03)
    a.pipe.abort(h)
    # An aborted handle is released at once (SPI v2): nothing is left to poll.
    assert a.pipe.pending() == 0
    with pytest.raises(DriverError, match="unknown handle"):
        a.pipe.poll(h)
    _quiet(a, b)


def test_wire_failure_fails_the_batch_and_returns_slots(pair_factory: Any) -> None:
    a, b, _, _ = pair_factory(fail_after=3)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(64)), list(range(64))))
    with pytest.raises(EngineError, match="injected wire failure"):
        _wait(lambda: a.pipe.poll(h))
    _quiet(a, b)


def test_disconnect_mid_stream_fails_batches_and_returns_slots(pair_factory: Any) -> None:
    a, b, _, _ = pair_factory(pages=64, item=4096, ring=32 << 10, chunk=4 << 10, delay=0.005)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(64)), list(range(64))))
    time.sleep(0.03)
    a.pipe.disconnect("b")
    b.pipe.disconnect("a")
    with pytest.raises(PeerLost):
        _wait(lambda: a.pipe.poll(h))
    _quiet(a, b)


def _grant_one(a: Side, b: Side) -> int:
    b.pipe.on_notice("a", msgpack.packb({"op": "want", "n": 1}))
    _wait(lambda: b.pipe.usage().granted == 1)
    return next(iter(b.pipe._in["a"].granted))


@pytest.mark.parametrize("bad", ["outside", "ungranted", "past-slot"])
def test_hostile_chunk_notice_writes_nothing_and_fails_typed(pair_factory: Any, bad: str) -> None:
    a, b, _, _ = pair_factory()
    before = b.pool.page_digests(list(range(64)))
    slot = _grant_one(a, b)
    dst = np.array([b.regions.kv[0].ptr], dtype=np.uint64)
    length = np.array([4096], dtype=np.uint64)
    offset = np.array([0], dtype=np.uint64)
    if bad == "outside":
        dst = np.array([b.regions.kv[0].ptr + b.regions.kv[0].length], dtype=np.uint64)
    elif bad == "ungranted":
        slot = slot + 1
    else:
        offset = np.array([b.pipe.config.chunk_bytes - 100], dtype=np.uint64)
    msg = {"op": "chunk", "slot": slot, "dst": dst.tobytes(), "len": length.tobytes(), "off": offset.tobytes()}
    b.pipe.on_notice("a", msgpack.packb(msg))
    with pytest.raises(ProtocolError, match="bad chunk from a"):
        b.pipe.inbound_idle("a")
    time.sleep(0.05)
    assert b.pool.page_digests(list(range(64))) == before
    b.pipe.on_notice("a", msgpack.packb({"op": "release", "slots": list(range(b.pipe.config.slots))}))
    _quiet(a, b)


def _record(side: Side) -> list[str]:
    """The ops of every notice ``side`` sends from now on (still delivered)."""
    ops: list[str] = []
    forward = side.notify

    def notify(peer: str, data: bytes) -> None:
        ops.append(msgpack.unpackb(data)["op"])
        forward(peer, data)

    side.notify = notify
    return ops


def test_lent_slots_carry_a_small_transfer_without_asking(pair_factory: Any) -> None:
    a, b, courier, _ = pair_factory()  # 4 slots of 8 KiB each way
    sent = _record(a)
    b.pipe.lend_ahead("a", 4096)  # one chunk's worth: one slot
    _wait(lambda: len(a.pipe._out["b"].credits) == 1)
    assert b.pipe.usage().granted == 1
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, [3], [9]))
    _finish(a, b, [h], courier)
    assert b.pool.page_digests([9]) == a.pool.page_digests([3])
    assert sent == ["chunk"], "the sender asked for a slot it had been lent"
    _quiet(a, b)


def test_a_small_write_that_finishes_at_once_completes_inside_submit_without_a_signal(pair_factory: Any) -> None:
    """Posted on the submitting thread and finished there (MemcpyLink writes at post time):
    the batch is complete when ``submit`` returns, its notice already sent, and no completion
    signal was raised (the core checks the batch right after ``submit``; a signal would only
    wake the driver's thread). A write that takes longer is left to the wire stage, which
    signals it."""
    a, b, courier, link = pair_factory()
    signals: list[int] = []
    a.pipe._completed = signals.append
    sent = _record(a)
    b.pipe.lend_ahead("a", 4096)
    _wait(lambda: len(a.pipe._out["b"].credits) == 1)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, [3], [9]))
    assert a.pipe.poll(h), "the write finished inside submit"
    assert sent == ["chunk"] and signals == []
    courier.q.join()
    _wait(lambda: b.pipe.inbound_idle("a"))
    assert b.pool.page_digests([9]) == a.pool.page_digests([3])

    # Finished only once the test says so (a deadline on the clock could pass before submit
    # returned on a loaded machine).
    finish = threading.Event()
    link.check = lambda token: finish.is_set()  # type: ignore[method-assign]
    b.pipe.lend_ahead("a", 4096)
    _wait(lambda: len(a.pipe._out["b"].credits) == 1)
    h2 = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, [4], [10]))
    assert not a.pipe.poll(h2)
    assert signals == []
    finish.set()
    _wait(lambda: signals == [h2])
    _finish(a, b, [h2], courier)
    assert b.pool.page_digests([10]) == a.pool.page_digests([4])
    _quiet(a, b)


def test_small_requests_moved_on_the_threads_at_hand_wake_no_stage_thread(
    pair_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One-chunk requests gathered, written and copied in on the submitting and notice-reading
    threads leave the stage threads asleep: only the sender's gather stage is woken, once per
    lend (it must give lent slots back when their hold ends). Every needless wake-up takes the
    interpreter from the thread that moves the request."""
    woken: dict[str, int] = {}

    class Counting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            answer = super().wait(timeout)
            name = threading.current_thread().name
            woken[name] = woken.get(name, 0) + 1
            return answer

    monkeypatch.setattr(pipeline_module.threading, "Condition", Counting)
    a, b, courier, _ = pair_factory()
    monkeypatch.undo()
    requests = 20
    for i in range(requests):
        b.pipe.lend_ahead("a", 4096)
        _wait(lambda: len(a.pipe._out["b"].credits) == 1)
        h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, [3 + i], [20 + i]))
        assert a.pipe.poll(h), "the write finished inside submit"
        courier.q.join()
        _wait(lambda: b.pipe.inbound_idle("a"))
    assert b.pool.page_digests(list(range(20, 20 + requests))) == a.pool.page_digests(list(range(3, 3 + requests)))
    stages = {
        f"{side}-{stage}": woken.get(f"{side}-{stage}", 0) for side in "ab" for stage in ("gather", "wire", "scatter")
    }
    assert stages["a-gather"] <= requests + 1
    assert {k: v for k, v in stages.items() if k != "a-gather"} == dict.fromkeys(
        ["a-wire", "a-scatter", "b-gather", "b-wire", "b-scatter"], 0
    )
    _quiet(a, b)


def test_unused_lent_slots_go_back_when_their_hold_ends(pair_factory: Any) -> None:
    a, b, courier, _ = pair_factory()
    b.pipe.grant_timeout = 0.4  # a hold of 0.1 s
    sent = _record(a)
    started = time.monotonic()
    b.pipe.lend_ahead("a", 1 << 30)  # more than the ring: LEND_MAX_SLOTS
    _wait(lambda: len(a.pipe._out["b"].credits) == LEND_MAX_SLOTS)
    assert b.pipe.usage().granted == LEND_MAX_SLOTS
    _wait(lambda: b.pipe.usage().granted == 0)
    assert time.monotonic() - started >= 0.09, "lent slots released before their hold ended"
    assert sent == ["release"]
    assert not a.pipe._out["b"].credits and not a.pipe._out["b"].lent
    # A transfer after that asks as usual.
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, [1, 2], [5, 6]))
    _finish(a, b, [h], courier)
    assert b.pool.page_digests([5, 6]) == a.pool.page_digests([1, 2])
    assert sent[1] == "want"
    _quiet(a, b)


def test_lending_keeps_half_the_ring_and_yields_to_a_waiting_peer(pair_factory: Any) -> None:
    a, b, _, _ = pair_factory(ring=128 << 10, chunk=8 << 10)  # 8 slots each way
    b.notify = lambda peer, data: None  # the lends go nowhere: they stay granted
    for p in ("p1", "p2", "p3", "p4", "p5"):
        b.pipe.connect(p, a.pipe.describe(), MemcpyLink())
        b.pipe.lend_ahead(p, 1 << 30)
        b.pipe.lend_ahead(p, 1 << 30)  # a second announcement adds nothing past the per-peer cap
    held = {p: len(i.granted) for p, i in b.pipe._in.items()}
    assert max(held.values()) <= LEND_MAX_SLOTS
    assert sum(held.values()) == b.pipe.config.slots // 2, held
    b.pipe.on_notice("a", msgpack.packb({"op": "want", "n": 8}))  # "a" now waits for the rest
    granted = len(b.pipe._in["a"].granted)
    b.pipe.lend_ahead("p1", 1 << 30)
    b.pipe.disconnect("p2")
    assert len(b.pipe._in["a"].granted) > granted, "a freed slot went to a lend, not to the waiting peer"
    assert len(b.pipe._in["p1"].granted) == held["p1"]


def test_a_receiver_cannot_lend_past_its_ring_twice_or_more_than_the_cap(pair_factory: Any) -> None:
    a, b, _, _ = pair_factory()  # b has 4 inbound slots
    b.notify = lambda peer, data: None
    out = a.pipe._out["b"]
    a.pipe.on_notice("b", encode_lend([0, 0], MAX_HOLD_MS))  # twice the same slot: one credit
    a.pipe.on_notice("b", encode_lend([1, 9], MAX_HOLD_MS))  # 9 is past the receiver's ring
    a.pipe.on_notice("b", encode_lend([2, 3], MAX_HOLD_MS))  # past the cap: ignored
    a.pipe.on_notice("b", encode_lend([], MAX_HOLD_MS))
    assert sorted(out.credits) == [0, 1] and sorted(out.lent) == [0, 1]
    with pytest.raises(ProtocolError, match="at most 2 are lent"):
        a.pipe.on_notice("b", encode_lend(list(range(LEND_MAX_SLOTS + 1)), MAX_HOLD_MS))
    with pytest.raises(ProtocolError, match=r"lend\.hold_ms"):
        a.pipe.on_notice("b", msgpack.packb({"op": "lend", "slots": [0], "hold_ms": MAX_HOLD_MS + 1}))
    with pytest.raises(ProtocolError, match=r"lend\.slots\[0\]"):
        a.pipe.on_notice("b", msgpack.packb({"op": "lend", "slots": [1 << 16], "hold_ms": 0}))
    assert sorted(out.credits) == [0, 1]
    # A ring description claiming more slots than any ring has is refused at connect.
    with pytest.raises(ProtocolError, match="inbound slots"):
        a.pipe.connect("x", {"ring": 4096, "slot_bytes": 1 << 20, "inbound_first": (1 << 16) + 1}, MemcpyLink())


class ThreadBoundCopy(MemcpyCopyEngine):
    """A copy engine with per-thread state (like CUDA streams): records the copying threads."""

    any_thread = False

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def copy(self, dst: Any, src: Any, length: Any) -> None:
        self.threads.add(threading.current_thread().name)
        super().copy(dst, src, length)


def _copied_on_the_threads_at_hand(a: Side, b: Side, courier: Courier, any_thread: bool, nbytes: int) -> bool:
    """Page 2 of ``a`` to page 1 of ``b`` (``nbytes``, with a credit lent for it) through copy
    engines that record their threads, bytes verified: ``True`` when it was gathered on this
    thread and scattered on the thread that read its notice, ``False`` when both stage threads
    copied it (anything else fails)."""
    engines = []
    for side in (a, b):
        engine = ThreadBoundCopy()
        engine.any_thread = any_thread
        side.pipe.copy_engine = engine
        engines.append(engine)
    b.pipe.lend_ahead("a", nbytes)
    _wait(lambda: len(a.pipe._out["b"].credits) == 1)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, [2], [1]))
    _finish(a, b, [h], courier)
    assert b.pool.page_digests([1]) == a.pool.page_digests([2])
    threads = (engines[0].threads, engines[1].threads)
    _quiet(a, b)
    if threads == ({threading.current_thread().name}, {courier.thread.name}):
        return True
    assert threads == ({"a-gather"}, {"b-scatter"})
    return False


@pytest.mark.parametrize("any_thread", [True, False])
def test_small_chunks_are_copied_on_the_calling_threads_only_when_the_engine_allows(
    pair_factory: Any, any_thread: bool
) -> None:
    a, b, courier, _ = pair_factory()
    assert _copied_on_the_threads_at_hand(a, b, courier, any_thread, 4096) is any_thread


@pytest.mark.parametrize("over", [False, True], ids=["at-the-limit", "just-over"])
def test_a_one_chunk_request_up_to_the_inline_limit_is_copied_on_the_threads_at_hand(
    pair_factory: Any, over: bool
) -> None:
    """A one-page request (one piece per KV region) that makes a chunk of exactly
    ``INLINE_CHUNK_MAX_BYTES`` is gathered on the submitting thread and scattered on the thread
    that reads its notice; a chunk just over it goes through both stage threads. Bytes
    verified either way."""
    limit = pipeline_module.INLINE_CHUNK_MAX_BYTES
    regions = 2  # the KV buffers of a Side's pool
    item = limit // regions + (4096 if over else 0)
    a, b, courier, _ = pair_factory(pages=4, item=item, ring=8 * limit, chunk=2 * limit)
    assert len(a.regions.kv) == regions
    assert _copied_on_the_threads_at_hand(a, b, courier, True, regions * item) is not over


@pytest.mark.parametrize(
    "doc",
    [
        {"op": "revoke", "slots": [SLOTS]},
        {"op": "revoke", "slots": [-1]},
        {"op": "revoke", "slots": [True]},
        {"op": "revoke", "slots": 3},
        {"op": "revoke", "slots": list(range(SLOTS)) * ((MAX_SLOTS // SLOTS) + 1)},
        {"op": "revoke", "slots": [], "n": 1},
        {"op": "revoke"},
    ],
)
def test_a_revoke_is_decoded_only_with_a_bounded_list_of_slots_of_the_ring(doc: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match="revoke"):
        decode_notice(msgpack.packb(doc), SLOTS)


def test_undecodable_notice_is_a_protocol_error(pair_factory: Any) -> None:
    _, b, _, _ = pair_factory()
    with pytest.raises(ProtocolError):
        b.pipe.on_notice("a", b"\xc1 not msgpack")
    with pytest.raises(ProtocolError, match="unknown staging notice"):
        b.pipe.on_notice("a", msgpack.packb({"op": "steal"}))


# --- two processes over real Mooncake ------------------------------------------------------------

BIG_PAGES, BIG_LAYERS, BIG_ITEM = 128, 4, 64 << 10  # 32 MiB per side; the ring below is 2 MiB
RING = {"staging.ring_bytes": str(2 << 20), "staging.chunk_bytes": str(256 << 10)}  # 4 slots each way


STAGED = ["mooncake-staged", "nixl-staged"]


def _staged_pair(
    driver: str,
    receiver_options: dict[str, str],
) -> tuple[Endpoint, KVPool, PeerProcess, Any]:
    pool = KVPool(BIG_PAGES, BIG_LAYERS, BIG_ITEM, 0, shared=False)
    pool.fill(21)
    local = Endpoint(
        pool.regions,
        pool.layout,
        drivers={driver: load_driver(driver)},
        name="prefill",
        driver_options=RING,
        timeouts=Timeouts(heartbeat_interval=0.2, heartbeat_timeout=2.0, transfer=30.0),
    )
    peer = PeerProcess(
        *("--driver", driver, "--pages", str(BIG_PAGES), "--layers", str(BIG_LAYERS)),
        *("--item", str(BIG_ITEM), "--aux-slots", "0", "--private", "--name", "decode"),
        *("--options", json.dumps({**RING, **receiver_options})),
        *("--timeouts", json.dumps({"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0})),
    )
    peer.call("connect", address=local.address)
    conn = local.accept(10)
    return local, pool, peer, conn


def _usage(local: Endpoint) -> dict[str, int]:
    (driver,) = local.drivers.values()
    return driver.ring_usage()  # type: ignore[attr-defined,no-any-return]


def _settled(local: Endpoint, peer: PeerProcess | None) -> None:
    (name,) = local.drivers

    def quiet() -> bool:
        mine = _usage(local)
        theirs = peer.call("ring_usage")[name] if peer else {"outbound": 0, "granted": 0, "busy": 0}
        return all(u[k] == 0 for u in (mine, theirs) for k in ("outbound", "granted", "busy"))

    _wait(quiet, 10)


@pytest.fixture
def staged_engines() -> None:
    require_engines()


@pytest.mark.usefixtures("staged_engines")
@pytest.mark.parametrize("driver", STAGED)
@pytest.mark.parametrize("delay", ["0", "0.01"])
def test_real_engine_transfers_larger_than_the_ring_concurrently(driver: str, delay: str) -> None:
    """16 requests of 8 MiB each (128 MiB) through a 2 MiB ring, four at a time; the second
    run slows the receiver (10 ms per chunk) so credits must hold the sender."""
    local, pool, peer, conn = _staged_pair(driver, {"staging.scatter_delay": delay})
    try:
        rng = np.random.default_rng(3)
        transfers = {}
        for i in range(16):
            src = rng.choice(BIG_PAGES, 32, replace=False).tolist()
            transfers[f"r{i}"] = (src, list(range((i % 4) * 32, (i % 4) * 32 + 32)))
        # Four rounds of four: destinations of one round never overlap.
        for round_ in range(4):
            batch = {t: transfers[t] for t in list(transfers)[round_ * 4 : round_ * 4 + 4]}
            peer.call("expect", transfers={t: d for t, (_, d) in batch.items()})
            senders = {t: conn.sender(t) for t in batch}
            for t, (src, _) in batch.items():
                while senders[t].state is State.BOOTSTRAPPING:
                    time.sleep(0.001)
                senders[t].send(src)
            for s in senders.values():
                assert s.wait(60) is State.SUCCESS
            states = peer.call("wait", tags=list(batch), timeout=60)["states"]
            assert all(v[0] == "SUCCESS" for v in states.values()), states
            for _t, (src, dst) in batch.items():
                assert peer.call("digests", pages=dst)["digests"] == pool.page_digests(src)
        usage = peer.call("ring_usage")[driver]
        assert usage["peak_inbound"] <= usage["slots"] == 4
        _settled(local, peer)
    finally:
        peer.close()
        local.close()
        pool.close()


def _big_transfer_in_flight(driver: str) -> tuple[Endpoint, KVPool, PeerProcess, Transfer]:
    """32 MiB streaming through the 2 MiB ring to a receiver slowed to 10 ms per chunk: it is
    still in flight for over a second."""
    local, pool, peer, conn = _staged_pair(driver, {"staging.scatter_delay": "0.01"})
    pages = list(range(BIG_PAGES))
    peer.call("expect", transfers={"big": pages})
    t = conn.sender("big")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    t.send(pages)
    time.sleep(0.2)
    return local, pool, peer, t


@pytest.mark.usefixtures("staged_engines")
@pytest.mark.parametrize("driver", STAGED)
def test_real_engine_announcement_lends_slots_that_come_back_unused(driver: str) -> None:
    """An announced transfer gets its credits lent with the announcement (two pages of 256 KiB:
    two 256 KiB chunks, two slots); used, they come back with the scatters; not used, they
    come back when their hold ends (a quarter of the 2 s grant timeout), and the transfer,
    sent after that, asks for its slots as usual."""
    local, pool, peer, conn = _staged_pair(driver, {})
    try:

        def granted() -> int:
            return int(peer.call("ring_usage")[driver]["granted"])

        for tag, dst, src, pause in (("used", [3, 4], [10, 11], False), ("later", [7, 8], [12, 13], True)):
            started = time.monotonic()
            peer.call("expect", transfers={tag: dst})
            _wait(lambda: granted() > 0, 5)
            assert granted() == 2, "the announcement lent other than the two slots its transfer needs"
            t = conn.sender(tag)
            while t.state is State.BOOTSTRAPPING:
                time.sleep(0.001)
            if pause:
                _wait(lambda: granted() == 0, 5)
                assert time.monotonic() - started >= 0.45, "lent slots came back before their hold ended"
            t.send(src)
            assert t.wait(30) is State.SUCCESS
            assert peer.call("wait", tags=[tag], timeout=30)["states"][tag][0] == "SUCCESS"
            assert peer.call("digests", pages=dst)["digests"] == pool.page_digests(src)
            _settled(local, peer)
    finally:
        peer.close()
        local.close()
        pool.close()


@pytest.mark.usefixtures("staged_engines")
@pytest.mark.parametrize("driver", STAGED)
def test_real_engine_abort_mid_stream_returns_both_rings(driver: str) -> None:
    local, pool, peer, t = _big_transfer_in_flight(driver)
    try:
        t.abort("preempted")
        state = peer.call("wait", tags=["big"], timeout=5)["states"]["big"]
        assert state[0] == "FAILED" and "preempted" in state[2]
        _settled(local, peer)
    finally:
        peer.close()
        local.close()
        pool.close()


@pytest.mark.usefixtures("staged_engines")
@pytest.mark.parametrize("driver", STAGED)
def test_real_engine_receiver_killed_mid_stream(driver: str) -> None:
    local, pool, peer, t = _big_transfer_in_flight(driver)
    try:
        peer.kill()
        with pytest.raises((PeerLost, EngineError)):
            t.wait(10)
        _settled(local, None)
    finally:
        peer.close()
        local.close()
        pool.close()


def _ops(sent: list[bytes], op: str) -> list[Any]:
    """The notices of kind ``op`` among ``sent``, decoded."""
    return [decode_notice(d, MAX_SLOTS) for d in sent if msgpack.unpackb(d)["op"] == op]


def _hog(b: Side, a: Side) -> list[bytes]:
    """Connect a peer "hog" to ``b`` that asks for every inbound slot; what ``b`` sends it."""
    to_hog: list[bytes] = []
    forward = b.notify
    b.notify = lambda peer, data: to_hog.append(data) if peer == "hog" else forward(peer, data)
    b.pipe.connect("hog", a.pipe.describe(), MemcpyLink())
    b.pipe.on_notice("hog", encode_want(b.pipe.config.slots))
    _wait(lambda: b.pipe.usage().granted == b.pipe.config.slots)
    return to_hog


def test_a_peer_sitting_on_revoked_credits_is_failed_and_its_slots_go_to_the_waiting_peer(pair_factory: Any) -> None:
    """A peer that asks for every inbound slot and never uses them: once its grants are older
    than the grant timeout and another peer waits, they are revoked (it is told); one that
    neither gives them back nor uses them within another grant timeout is failed (its idle
    check and its next notice raise, so the core ends its connection), and its slots go to the
    waiting peer then, not before: until then it may still be writing them. Not only once
    its connection is gone: a hoarder with no transfer is never asked whether it is idle."""
    a, b, courier, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10)  # 4 slots each way
    b.pipe.grant_timeout = 0.3
    started = time.monotonic()  # before the hog's grants: they are at most this old
    to_hog = _hog(b, a)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(16)), list(range(16))))
    with pytest.raises(ProtocolError, match="revoked staging slots"):
        _wait(lambda: not b.pipe.inbound_idle("hog"), timeout=10)
    assert time.monotonic() - started >= 0.55, "revoked, or failed, before the grant timeout passed twice"
    (revoke,) = _ops(to_hog, "revoke")
    assert sorted(revoke.slots) == sorted(s for g in _ops(to_hog, "grant") for s in g.slots)
    with pytest.raises(ProtocolError, match="revoked staging slots"):
        b.pipe.on_notice("hog", encode_release([]))
    _finish(a, b, [h], courier)
    b.pipe.disconnect("hog")  # what the core does once the hog's idle check raised
    assert b.pool.page_digests(list(range(16))) == a.pool.page_digests(list(range(16)))
    _quiet(a, b)


def test_a_late_write_into_a_revoked_slot_cannot_land_in_another_peers_chunk(pair_factory: Any) -> None:
    """The hog took its granted slots for writes just before the receiver revoked them, and its
    writes land late (its outbound was stuck behind another peer): they must land in slots
    nobody else was given. The other peer's transfer is intact, and the hog's chunks in its
    revoked slots are accepted (they were granted) and copied in."""
    a, b, courier, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10)  # 4 slots each way
    b.pipe.grant_timeout = 0.3
    to_hog = _hog(b, a)
    hog_slots = sorted(s for g in _ops(to_hog, "grant") for s in g.slots)
    # The chunk notices of the other peer are held back until the hog's writes landed.
    held: list[bytes] = []
    gate = threading.Lock()
    opened = False
    forward = a.notify

    def notify(peer: str, data: bytes) -> None:
        with gate:
            if not opened and msgpack.unpackb(data)["op"] == "chunk":
                held.append(data)
                return
        forward(peer, data)

    a.notify = notify
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(16)), list(range(16))))
    _wait(lambda: bool(held or _ops(to_hog, "revoke")), timeout=10)
    time.sleep(0.05)
    hog_chunks = chunk_runs(plan(a.regions.kv, b.regions.kv, [28, 29, 30, 31], [28, 29, 30, 31]), 4 << 10)
    for slot, c in zip(hog_slots, hog_chunks, strict=False):
        ctypes.memset(b.pipe._in_ptr(slot), 0xEE, 4 << 10)  # the hog's late write
        b.pipe.on_notice("hog", encode_chunk(slot, c.dst, c.length, c.offset))
    with gate:
        opened = True
        for data in held:
            forward("b", data)
    _finish(a, b, [h], courier)
    assert b.pool.page_digests(list(range(16))) == a.pool.page_digests(list(range(16))), "the hog's bytes landed"
    for c in hog_chunks[: len(hog_slots)]:
        for dst, n in zip(as_list(c.dst), as_list(c.length), strict=True):
            assert ctypes.string_at(dst, n) == b"\xee" * n
    assert b.pipe.inbound_idle("hog")
    _quiet(a, b)


class HungLink(MemcpyLink):
    """Writes to a peer that answers nothing until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def post(self, local: int, remote: int, length: int) -> int:
        self.posted += 1
        return self.posted

    def check(self, token: int) -> bool:
        return self.release.is_set()


def test_a_sender_stuck_behind_a_hung_peer_gives_revoked_credits_back(pair_factory: Any) -> None:
    """``a`` holds ``b``'s every slot but cannot use them (its outbound ring is full of writes
    to a hung peer "c") while "d" waits at ``b``: ``b`` revokes them, ``a`` gives them back
    (none was taken for a write) and asks again, "d" is served, and ``a``'s transfer completes
    with every byte in place once the hung peer answers."""
    a, b, courier, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10)  # 4 slots each way
    b.pipe.grant_timeout = 0.3
    forward_a, forward_b = a.notify, b.notify
    a.notify = lambda peer, data: None if peer == "c" else forward_a(peer, data)
    to_d: list[bytes] = []
    b.notify = lambda peer, data: to_d.append(data) if peer == "d" else forward_b(peer, data)
    c_ring = np.zeros(32 << 10, dtype=np.uint8)
    hung = HungLink()
    a.pipe.connect("c", {"ring": int(c_ring.ctypes.data), "slot_bytes": 4 << 10, "inbound_first": 4}, hung)
    hc = a.pipe.submit("c", plan(a.regions.kv, b.regions.kv, list(range(8)), list(range(8))))
    a.pipe.on_notice("c", encode_grant([0, 1, 2, 3]))
    _wait(lambda: a.pipe.usage().outbound == a.pipe.config.slots)  # every outbound slot on the hung wire
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(16)), list(range(16))))
    _wait(lambda: len(a.pipe._out["b"].credits) == b.pipe.config.slots)
    b.pipe.connect("d", a.pipe.describe(), MemcpyLink())
    b.pipe.on_notice("d", encode_want(1))
    _wait(lambda: bool(_ops(to_d, "grant")), timeout=10)
    assert b.pipe.inbound_idle("a"), "a gave its revoked slots back: it is not failed"
    b.pipe.on_notice("d", encode_release([s for g in _ops(to_d, "grant") for s in g.slots]))
    hung.release.set()
    _finish(a, b, [h], courier)
    assert b.pool.page_digests(list(range(16))) == a.pool.page_digests(list(range(16)))
    a.pipe.abort(hc)
    _quiet(a, b)
    assert not courier.errors


def test_a_raising_callback_does_not_stop_the_stages(pair_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The core's ``completed`` raises once on the sender's wire stage, its ``inbound_progress``
    once on the receiver's scatter stage: each is logged, and the stages move the next
    transfer as before."""
    a, b, courier, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10, delay=0.001)

    def once(what: str) -> Callable[[Any], None]:
        raised: list[bool] = []

        def callback(_: Any) -> None:
            if not raised:
                raised.append(True)
                raise RuntimeError(f"injected {what} failure")

        return callback

    a.pipe._completed = once("completed")
    b.pipe._progress = once("progress")
    for pages in (list(range(8)), list(range(8, 16))):
        h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, pages, pages))
        _finish_within(a, b, [h], courier, 5.0)
        assert b.pool.page_digests(pages) == a.pool.page_digests(pages)
    messages = [r.getMessage() for r in caplog.records]
    assert any("the wire stage failed" in m and "injected completed" in m for m in messages)
    assert any("the scatter stage failed" in m and "injected progress" in m for m in messages)
    assert a.pipe.threads == 3 and b.pipe.threads == 3
    _quiet(a, b)


def _finish_within(a: Side, b: Side, handles: list[int], courier: Courier, timeout: float) -> None:
    for h in handles:
        _wait(lambda h=h: a.pipe.poll(h), timeout)  # type: ignore[misc]
    courier.q.join()
    _wait(lambda: b.pipe.inbound_idle("a"), timeout)


class RaisingCopy(MemcpyCopyEngine):
    """Copies as memcpy, except that the ``fail``-th copy raises something no engine should."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.calls = 0
        self.fail = fail

    def copy(self, dst: Any, src: Any, length: Any) -> None:
        self.calls += 1
        if self.calls == self.fail:
            raise KeyError("an engine bug")  # caught as any exception, as before
        super().copy(dst, src, length)


def test_a_bug_in_a_stage_fails_its_batch_returns_its_slots_and_the_stage_goes_on(
    pair_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception where none is expected (here: the wire stage's handling of written chunks,
    before their notices went out) fails their batch with EngineError, gives their outbound
    slots back and the receiver's slots too (released unread); a later transfer moves."""
    a, b, courier, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10)
    real = a.pipe._written
    calls: list[int] = []

    def written(done: Any, *args: Any, **kw: Any) -> list[int]:
        if threading.current_thread().name.endswith("-wire"):
            calls.append(len(done))
            if len(calls) == 1:
                raise RuntimeError("injected bug")
        return real(done, *args, **kw)

    monkeypatch.setattr(a.pipe, "_written", written)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(8)), list(range(8))))
    with pytest.raises(EngineError, match="wire stage failed: RuntimeError: injected bug"):
        _wait(lambda: a.pipe.poll(h), 5)
    h2 = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(8, 16)), list(range(8, 16))))
    _finish_within(a, b, [h2], courier, 5.0)
    assert b.pool.page_digests(list(range(8, 16))) == a.pool.page_digests(list(range(8, 16)))
    _quiet(a, b)  # the receiver's slots the failed chunks were written to came back unread


def test_close_abandons_writes_that_never_complete_and_says_the_ring_must_stay(pair_factory: Any) -> None:
    """Writes in flight to a peer that never answers do not keep the wire stage alive: close
    stops every stage once its deadline nears, fails their batch, and answers ``False``: the
    engine may still read the ring for those writes, so the driver must not free it."""
    a, b, _, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10)
    hung = HungLink()
    a.pipe.disconnect("b")
    a.pipe.connect("b", b.pipe.describe(), hung)
    h = a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(8)), list(range(8))))
    a.pipe.on_notice("b", encode_grant([0, 1, 2, 3]))
    _wait(lambda: hung.posted == 4)
    started = time.monotonic()
    assert a.pipe.close(timeout=2) is False
    assert 1.0 <= time.monotonic() - started < 2.5 and a.pipe.threads == 0
    assert a.pipe.writes_abandoned
    with pytest.raises(PeerLost):
        a.pipe.poll(h)
    assert a.pipe.usage().outbound == 0


def test_close_waits_for_writes_in_flight_before_it_lets_the_ring_go(pair_factory: Any) -> None:
    """The ring may be freed once ``close`` answers ``True``: a write the engine is still doing
    at close is waited for, not abandoned (it read freed memory otherwise)."""
    a, b, _, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10)
    slow = HungLink()
    a.pipe.disconnect("b")
    a.pipe.connect("b", b.pipe.describe(), slow)
    a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(8)), list(range(8))))
    a.pipe.on_notice("b", encode_grant([0, 1, 2, 3]))
    _wait(lambda: slow.posted == 4)
    threading.Timer(0.3, slow.release.set).start()
    started = time.monotonic()
    assert a.pipe.close(timeout=5) is True
    assert time.monotonic() - started >= 0.25, "close returned while writes were still in flight"
    assert a.pipe.threads == 0 and not a.pipe.writes_abandoned


class StuckCopy(MemcpyCopyEngine):
    """A copy that blocks until ``release`` is set (a hung device, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.closed = False

    def copy(self, dst: Any, src: Any, length: Any) -> None:
        self.entered.set()
        self.release.wait(10)
        super().copy(dst, src, length)

    def close(self) -> None:
        self.closed = True


def test_close_says_when_a_stage_did_not_stop_and_leaves_the_copy_engine_open(pair_factory: Any) -> None:
    a, b, _, _ = pair_factory(pages=32, item=4096, ring=32 << 10, chunk=4 << 10)
    stuck = StuckCopy()
    a.pipe.copy_engine = stuck
    a.pipe.submit("b", plan(a.regions.kv, b.regions.kv, list(range(8)), list(range(8))))
    assert stuck.entered.wait(5)
    assert a.pipe.close(timeout=0.3) is False
    assert not stuck.closed, "the copy engine was closed under a stage still copying"
    stuck.release.set()
    _wait(lambda: a.pipe.threads == 0, 5)
    assert a.pipe.close(timeout=5) is True and stuck.closed


def test_staged_drivers_leak_the_ring_and_engine_when_a_stage_did_not_stop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Freeing the ring or closing the engine under a stage thread that may still touch them
    would be a use-after-free: both staged drivers keep them (referenced) and warn."""
    from kvtransport.staging import transport as transport_module
    from kvtransport_mooncake.staged import MooncakeStaged
    from kvtransport_nixl.staged import NixlStaged

    mooncake = MooncakeStaged(mock.Mock())
    engine = mock.Mock()
    mooncake._engine, mooncake._ring = engine, (4096, 1 << 20)
    monkeypatch.setattr(mooncake, "stop_pipeline", lambda: False)
    mooncake.close()
    engine.engine.free_managed_buffer.assert_not_called()
    engine.close.assert_not_called()
    assert any(engine in kept for kept in transport_module._ABANDONED)

    nixl = NixlStaged(mock.Mock())
    agent, ring_map = mock.Mock(), mock.Mock()
    nixl._agent, nixl._ring_map, nixl._ring_reg = agent, ring_map, object()
    nixl._remote["p"] = "remote-agent"
    monkeypatch.setattr(nixl, "stop_pipeline", lambda: False)
    nixl.close()
    agent.deregister_memory.assert_not_called()
    agent.remove_remote_agent.assert_not_called()
    ring_map.close.assert_not_called()
    assert nixl._agent is None and any(agent in kept for kept in transport_module._ABANDONED)
    assert sum("leaking" in r.getMessage() for r in caplog.records) == 2


@settings(max_examples=400)
@given(
    pieces=st.lists(
        st.tuples(
            st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 9000)),
            st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 9000)),
        ),
        min_size=1,
        max_size=20,
    ),
    room=st.sampled_from([4096, 8192]),
)
def test_the_ring_slot_bound_holds_for_any_integers_on_both_paths(pieces: list[tuple[int, int]], room: int) -> None:
    """A chunk's pieces must lie inside their ring slot, whatever uint64s a peer sends: the
    plain-Python check of a few pieces and the vectorised one of many both answer as exact
    integer arithmetic does (no wrap-around in either)."""
    offset = np.array([o for o, _ in pieces], dtype=np.uint64)
    length = np.array([n for _, n in pieces], dtype=np.uint64)
    exact = all(o + n <= room for o, n in pieces)
    assert receiving_module._within_slot(offset, length, room) is exact
    with mock.patch.object(receiving_module, "FEW_PIECES", 0):
        assert receiving_module._within_slot(offset, length, room) is exact
