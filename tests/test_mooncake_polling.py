"""How ``mooncake-gdr`` waits for a large batch: which writes it checks, how often, and what it
leaves behind on a failure or a stop. The writes themselves run on the real engine in
``test_conformance_engines.py`` and ``test_engine_faults.py``; here a scripted stand-in for the
native engine counts the calls the polling loop makes, which the real engine cannot show."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

engine_mod = pytest.importorskip("kvtransport_mooncake.engine")
EngineError = pytest.importorskip("kvtransport.spi.errors").EngineError


class Clock:
    """The polling loop's ``time``: sleeping is what moves it (the loop's own calls take none)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


class ScriptedEngine:
    """Writes end one after another, ``WRITE_S`` each, in the order they were posted;
    ``fail`` fails that one. ``stop`` is set once five writes were posted."""

    WRITE_S = 15e-6

    def __init__(self, clock: Clock, fail: int | None = None, stop: threading.Event | None = None) -> None:
        self.clock = clock
        self.posted: list[int] = []
        self.ends: list[float] = []
        self.checks = 0
        self.released: set[int] = set()  # ids whose end a check has reported (Mooncake frees them then)
        self.fail = fail
        self.stop = stop

    def transfer_submit_write(self, session: str, src: int, dst: int, length: int) -> int:
        self.posted.append(len(self.posted) + 1)
        previous = self.ends[-1] if self.ends else 0.0
        self.ends.append(max(previous, self.clock.now) + self.WRITE_S)
        if self.stop is not None and len(self.posted) == 5:
            self.stop.set()
        return self.posted[-1]

    def transfer_check_status(self, batch: int) -> int:
        assert batch not in self.released, f"write {batch} checked after its end was reported"
        self.checks += 1
        if self.clock.now < self.ends[batch - 1]:
            return 0
        self.released.add(batch)
        return -1 if batch == self.fail else 1


def polling_engine(native: ScriptedEngine) -> object:
    eng = engine_mod.Engine.__new__(engine_mod.Engine)
    eng.driver, eng.protocol, eng.engine = "mooncake-gdr", "tcp", native
    return eng


def write(native: ScriptedEngine, n: int, window: int, stop: threading.Event | None = None) -> None:
    eng = polling_engine(native)
    with mock.patch.object(engine_mod, "time", native.clock):
        eng.write_polled("peer:1", list(range(n)), list(range(n)), [4096] * n, window, stop)  # type: ignore[attr-defined]


@given(n=st.integers(1, 400), window=st.integers(1, 256))
def test_a_write_checks_about_once_per_descriptor_whatever_the_window(n: int, window: int) -> None:
    # Checking every write in flight on each pass costs up to ``window`` calls a pass; on two
    # cores that took the CPU the engine's own threads needed (0.5 s of 0.6 s per 512 MiB).
    native = ScriptedEngine(Clock())
    write(native, n, window)
    assert native.posted == list(range(1, n + 1))
    assert native.released == set(native.posted), "every write's end was seen"
    # Each pass checks the writes it finds ended and the first one still running; a pass that
    # found none ended sleeps. So at most n checks find an end, and one a pass does not, with
    # at most n passes that found an end and one per sleep otherwise.
    assert native.checks <= 2 * n + native.clock.sleeps + 1


def test_a_failed_write_raises_and_every_posted_write_is_waited_for() -> None:
    native = ScriptedEngine(Clock(), fail=30)
    with pytest.raises(EngineError, match="failed"):
        write(native, 100, 16)
    # Nothing posted is left running behind the error (Mooncake cannot cancel a write).
    assert native.released == set(native.posted)
    assert len(native.posted) < 100, "no write is posted after the failure is seen"


def test_a_stop_posts_no_more_and_waits_for_what_was_posted() -> None:
    stop = threading.Event()
    native = ScriptedEngine(Clock(), stop=stop)
    write(native, 100, 8, stop)
    assert len(native.posted) == 5
    assert native.released == set(native.posted)


class TickedEngine:
    """Write ``k`` ends once the test has advanced ``tick`` to ``k`` (one more between polls, as
    time passes between the runner's checks); ``fail`` fails that write, ``timeout`` makes it
    report -2 (not freed by Mooncake then)."""

    def __init__(self, fail: int | None = None, timeout: int | None = None) -> None:
        self.fail, self.timeout = fail, timeout
        self.tick = 0
        self.checks = 0
        self.posted: list[int] = []
        self.released: set[int] = set()

    def transfer_submit_write(self, session: str, src: int, dst: int, length: int) -> int:
        self.posted.append(len(self.posted) + 1)
        return self.posted[-1]

    def transfer_check_status(self, batch: int) -> int:
        assert batch not in self.released, f"write {batch} checked after its end was reported"
        self.checks += 1
        if batch == self.timeout:
            return -2
        if batch > self.tick:
            return 0
        self.released.add(batch)
        return -1 if batch == self.fail else 1


@pytest.fixture
def inline_path() -> Iterator[Callable[[TickedEngine], Any]]:
    """A ``mooncake-gdr`` data path whose engine is the scripted one (its worker pool shut down
    after the test)."""
    from concurrent.futures import ThreadPoolExecutor

    gdr = pytest.importorskip("kvtransport_mooncake.gdr")
    pools: list[ThreadPoolExecutor] = []

    def make(native: TickedEngine) -> Any:
        path = gdr.MooncakeGDR(None)
        path._engine = polling_engine(native)
        path._pool = ThreadPoolExecutor(1)
        path._peers = {"peer": "peer:1"}
        pools.append(path._pool)
        return path

    yield make
    for pool in pools:
        pool.shutdown(wait=True)


def small_batch(path: Any, n: int) -> int:
    from kvtransport.spi.plan import Runs

    runs = Runs(*(np.arange(n, dtype=np.uint64) * 4096 for _ in range(2)), np.full(n, 4096, dtype=np.uint64))
    return int(path.submit("peer", runs))


def test_a_small_batch_is_polled_oldest_first_and_ends_with_every_write(inline_path: Any) -> None:
    native = TickedEngine()
    path = inline_path(native)
    h = small_batch(path, 10)
    polls = 1
    while not path.poll(h):
        native.tick += 1
        polls += 1
        assert polls < 100
    assert native.released == set(native.posted) == set(range(1, 11))
    # Oldest first, up to the first still running: a poll checks the writes that ended and
    # one more (the old loop checked every write in flight on every poll: 65 checks here).
    assert native.checks <= polls + 10, (native.checks, polls)
    assert path.settled(h)


@pytest.mark.parametrize("how", ["fail", "timeout"])
def test_a_small_batch_that_fails_raises_and_leaves_no_write_running(how: str, inline_path: Any) -> None:
    native = TickedEngine(**{how: 4})
    path = inline_path(native)
    h = small_batch(path, 10)
    with pytest.raises(EngineError, match="failed" if how == "fail" else "timed out"):
        for _ in range(100):
            path.poll(h)
            native.tick += 1
    native.tick = 100  # the rest end meanwhile
    # The writes behind the failed one are drained on the worker; the core asks ``settled``.
    deadline = time.monotonic() + 10
    while not path.settled(h):
        assert time.monotonic() < deadline, "the writes behind the failure were never drained"
        time.sleep(0.01)
    assert native.released >= set(range(1, 11)) - {4}, "a posted write was left running"
