"""The driver runner: calls one at a time and in order, on the caller's thread only when the
driver allows it and the runner is idle, and completions checked where they are signalled."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvtransport.runtime.config import Limits
from kvtransport.runtime.endpoint import Endpoint, State
from kvtransport.runtime.runner import DriverRunner
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import KVTransportError
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import KVPool

pytestmark = pytest.mark.timeout(60)


class _Engine:
    """What the runner reads of a driver: its two class flags. It records who called it."""

    signals_completion = True

    def __init__(self, thread_agnostic: bool) -> None:
        self.thread_agnostic = thread_agnostic


class _Posted:
    """Stands in for the I/O thread: what the runner posts, run by the test."""

    def __init__(self) -> None:
        self.q: queue.Queue[Callable[[], None]] = queue.Queue()

    def __call__(self, fn: Callable[[], None]) -> None:
        self.q.put(fn)

    def run(self, n: int, timeout: float = 5.0) -> None:
        for _ in range(n):
            self.q.get(timeout=timeout)()


def _runner(thread_agnostic: bool) -> tuple[DriverRunner, _Posted]:
    posted = _Posted()
    return DriverRunner("stub", _Engine(thread_agnostic), posted), posted  # type: ignore[arg-type]


def test_call_here_runs_on_the_callers_thread_when_idle() -> None:
    runner, posted = _runner(True)
    try:
        seen: list[Any] = []
        runner.call_here(lambda: threading.get_ident(), lambda result, error: seen.append((result, error)))
        posted.run(1)
        assert seen == [(threading.get_ident(), None)]
        assert runner.inline_calls == 1
    finally:
        assert runner.stop()


def test_call_here_goes_through_the_thread_unless_the_driver_allows_it() -> None:
    runner, posted = _runner(False)
    try:
        seen: list[Any] = []
        runner.call_here(lambda: threading.get_ident(), lambda result, error: seen.append(result))
        posted.run(1)
        assert seen and seen[0] != threading.get_ident()
        assert runner.inline_calls == 0
    finally:
        assert runner.stop()


def test_try_here_answers_on_the_callers_thread_only_when_the_runner_could_take_it() -> None:
    """``try_here``: the answer in the caller's own pass when the driver allows it and its
    thread is idle (an error typed, nothing posted); otherwise not run at all, so the caller
    takes the queued way and nothing overtakes a call queued before it."""
    runner, posted = _runner(True)
    release = threading.Event()
    try:
        assert runner.try_here(threading.get_ident) == (True, threading.get_ident(), None)

        def broken() -> None:
            raise ValueError("engine said no")

        ran, result, error = runner.try_here(broken)
        assert ran and result is None and isinstance(error, KVTransportError) and "engine said no" in str(error)
        runner.call(lambda: release.wait(5))
        time.sleep(0.05)  # the runner's thread is inside that call now
        assert runner.try_here(threading.get_ident) == (False, None, None)
        release.set()
        assert posted.q.empty()
    finally:
        release.set()
        assert runner.stop()
    assert runner.try_here(threading.get_ident) == (False, None, None)  # stopped
    not_agnostic, _ = _runner(False)
    try:
        assert not_agnostic.try_here(threading.get_ident) == (False, None, None)
    finally:
        assert not_agnostic.stop()


def test_a_busy_runner_queues_in_order_and_calls_never_overlap() -> None:
    runner, posted = _runner(True)
    release = threading.Event()
    inside = threading.Lock()
    order: list[int] = []
    overlaps: list[int] = []

    def step(i: int, block: bool = False) -> Callable[[], int]:
        def fn() -> int:
            if not inside.acquire(blocking=False):
                overlaps.append(i)
                return i
            try:
                if block:
                    release.wait(5)
                order.append(i)
                return threading.get_ident()
            finally:
                inside.release()

        return fn

    try:
        runner.call(step(0, block=True))
        time.sleep(0.05)  # the runner's thread is inside call 0 now
        for i in range(1, 5):
            runner.call_here(step(i))  # must queue behind call 0, not run beside it
        assert order == [] and runner.inline_calls == 0
        release.set()
        deadline = time.monotonic() + 5
        while len(order) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == [0, 1, 2, 3, 4]
        # From many threads at once: every call ran alone.
        threads = [
            threading.Thread(target=lambda k=k: [runner.call_here(step(100 * k + j)) for j in range(50)])
            for k in range(1, 5)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        deadline = time.monotonic() + 5
        while len(order) < 205 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(order) == 205 and not overlaps
        for k in range(1, 5):
            mine = [i for i in order if 100 * k <= i < 100 * k + 50]
            assert mine == sorted(mine), "one thread's calls ran out of order"
    finally:
        release.set()
        assert runner.stop()
    assert posted.q.empty()  # no ``then`` was given


def test_a_signalled_watch_is_checked_on_the_signalling_thread() -> None:
    runner, posted = _runner(True)
    done = threading.Event()
    checked_on: list[int] = []

    def check() -> bool:
        checked_on.append(threading.get_ident())
        # The runner's own back-off checks go on meanwhile (a safety net): they must not be the
        # ones to see it finish, or this would race with the signal below.
        return done.is_set() and threading.get_ident() != runner._thread.ident

    results: list[Any] = []
    try:
        runner.call(lambda: runner.watch(("batch", 1), check, lambda r, e: results.append((r, e)), lambda: None))
        posted.run(1)  # ``first``: the batch is known to the I/O thread before its result
        assert checked_on and runner.watching == 1
        done.set()
        signaller: list[int] = []

        def signal() -> None:
            signaller.append(threading.get_ident())
            runner.signal(("batch", 1))

        t = threading.Thread(target=signal)
        t.start()
        t.join(5)
        posted.run(1)
        assert results == [(True, None)]
        assert checked_on[-1] == signaller[0]
        assert runner.watching == 0
    finally:
        assert runner.stop()


def test_a_prefix_signal_wakes_the_runner_only_for_a_matching_watch() -> None:
    """A staged driver signals a peer's prefix on every arrival; with no watch of that prefix
    the runner's thread must not be woken for it (nothing is queued), and with one the watch is
    checked and finishes."""
    runner, posted = _runner(True)
    done = threading.Event()
    results: list[Any] = []
    try:
        runner.signal_prefix(("peer-a",))
        assert not runner._prefixes, "a prefix no watch starts with was queued"
        runner.call(
            lambda: runner.watch(("peer-b", 1), done.is_set, lambda r, e: results.append(r), lambda: None, spin=False)
        )
        posted.run(1)
        runner.signal_prefix(("peer-a",))
        assert not runner._prefixes
        done.set()
        runner.signal_prefix(("peer-b",))
        posted.run(1)
        assert results == [True] and runner.watching == 0
    finally:
        assert runner.stop()


def test_a_prefix_signal_from_another_thread_survives_watches_ending_meanwhile() -> None:
    """The staging threads signal a peer's prefix while the runner's thread ends watches of its
    own (batches that finished on a timed poll), without the runner's lock. The signal's scan
    once iterated the watch table itself and raised "dictionary changed size during iteration"
    in the signalling thread, which killed the scatter stage for good. Here a watch ends in the
    middle of the scan, deterministically: a key whose slicing (the scan's prefix test) removes
    another watch, as the runner's thread would at that moment."""
    runner = DriverRunner("polled", object(), lambda fn: None)  # type: ignore[arg-type]
    removed: list[Any] = []

    class EndsAnotherWatch(tuple[Any, ...]):
        def __getitem__(self, index: Any) -> Any:
            if isinstance(index, slice) and not removed:
                victim = next(k for k in runner._watches if k is not self)
                removed.append(runner._watches.pop(victim))
            return super().__getitem__(index)

    try:
        runner._watches[EndsAnotherWatch(("inbound", "other", 1))] = None  # type: ignore[assignment]
        for i in range(2, 10):
            runner._watches[("inbound", "other", i)] = None  # type: ignore[assignment]
        runner.signal_prefix(("inbound", "peer"))  # no watch matches: the whole table is scanned
        assert removed, "the scan never tested the key's prefix"
        assert not runner._prefixes
    finally:
        runner._watches.clear()
        assert runner.stop()


def test_a_watch_done_at_once_posts_first_and_result_in_one_call() -> None:
    runner, posted = _runner(True)
    events: list[str] = []
    try:
        runner.call_here(
            lambda: runner.watch(
                ("batch", 2), lambda: True, lambda r, e: events.append("result"), lambda: events.append("first")
            )
        )
        posted.run(1)
        assert events == ["first", "result"]
        assert posted.q.empty()
    finally:
        assert runner.stop()


@pytest.mark.parametrize("inline_bytes", [Limits().inline_submit_bytes, 1])
def test_send_submits_small_batches_on_the_callers_thread(inline_bytes: int) -> None:
    """Through an endpoint pair on the fake driver: a batch within ``inline_submit_bytes``
    is submitted on the sender's thread, a bigger one on the driver's thread; both land."""
    a_pool, b_pool = KVPool(16, 2, 512, 4), KVPool(16, 2, 512, 4)
    a_pool.fill(3)
    drivers: dict[str, type[KVTransport]] = {"fake": FakeDriver}
    try:
        with (
            Endpoint(
                a_pool.regions, a_pool.layout, drivers=drivers, limits=Limits(inline_submit_bytes=inline_bytes)
            ) as a,
            Endpoint(b_pool.regions, b_pool.layout, drivers=drivers) as b,
        ):
            recv_conn = b.connect(a.address)
            send_conn = a.accept(5)
            rx = recv_conn.expect("t", [5, 6])
            tx = send_conn.sender("t")
            deadline = time.monotonic() + 5
            while tx.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
                time.sleep(0.001)
            tx.send([1, 2])
            tx.wait(10)
            rx.wait(10)
            assert a.runners["fake"].inline_calls == (1 if inline_bytes > 1 else 0)
            assert b_pool.page_digests([5, 6]) == a_pool.page_digests([1, 2])
    finally:
        a_pool.close()
        b_pool.close()


def test_a_chunk_without_runs_does_not_overtake_a_queued_one() -> None:
    """The last chunk carries no runs while the chunk before it still waits in the driver's
    queue: "done" must count that chunk's batch (the receiver checks the bytes)."""
    a_pool, b_pool = KVPool(16, 2, 512, 4), KVPool(16, 2, 512, 4)
    a_pool.fill(5)
    drivers: dict[str, type[KVTransport]] = {"fake": FakeDriver}
    try:
        with (
            Endpoint(a_pool.regions, a_pool.layout, drivers=drivers) as a,
            Endpoint(b_pool.regions, b_pool.layout, drivers=drivers) as b,
        ):
            recv_conn = b.connect(a.address)
            send_conn = a.accept(5)
            rx = recv_conn.expect("t", [7, 8, 9])
            tx = send_conn.sender("t")
            deadline = time.monotonic() + 5
            while tx.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
                time.sleep(0.001)
            gate = threading.Event()
            a.runners["fake"].call(lambda: gate.wait(5))  # the driver's thread is busy
            time.sleep(0.02)
            tx.send([1, 2, 3], last=False)  # queued behind the busy call
            tx.send([], last=True)  # no runs: must wait its turn in the same queue
            time.sleep(0.05)
            assert not tx.state.final, "the sender finished before its batch reached the driver"
            gate.set()
            tx.wait(10)
            rx.wait(10)
            assert b_pool.page_digests([7, 8, 9]) == a_pool.page_digests([1, 2, 3])
    finally:
        a_pool.close()
        b_pool.close()


@pytest.mark.parametrize("here_s", [0.0, 5.0])
def test_a_callers_wait_sees_a_quick_batch_finish_on_its_own_thread(here_s: float) -> None:
    """``watch(here_s=...)`` from a caller's thread: a check that turns true within the wait is
    finished there (its result posted by the caller); without a wait the runner takes it over."""
    runner, posted = _runner(True)
    try:
        checked_on: list[int] = []
        seen: list[Any] = []

        def check() -> bool:
            checked_on.append(threading.get_ident())
            return len(checked_on) >= 3

        def submit() -> None:
            runner.watch(("batch", 1), check, lambda result, error: seen.append((result, error)), here_s=here_s)

        runner.call_here(submit)
        if here_s:
            assert set(checked_on) == {threading.get_ident()} and len(checked_on) == 3
            assert runner.watching == 0
        posted.run(1)
        assert seen == [(True, None)]
        if not here_s:
            assert checked_on[0] == threading.get_ident()
            assert any(t != threading.get_ident() for t in checked_on[1:]), "the runner should finish the watch"
    finally:
        runner.stop()
