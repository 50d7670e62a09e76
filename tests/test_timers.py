"""The I/O thread's timer heap: due timers fire in deadline order, cancelled ones never fire,
and ``len()`` is the number of live timers whatever the interleaving (it is read by
``Endpoint.stats()`` from other threads, so it must be one counter that is never negative)."""

from __future__ import annotations

import sys
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.runtime.timers import TimerHeap

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(0, 10)),
        st.tuples(st.just("cancel"), st.integers(0, 200)),
        st.tuples(st.just("run"), st.floats(0, 10)),
    ),
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_len_counts_live_timers_and_only_live_ones_fire(program: list[tuple[str, float]]) -> None:
    heap = TimerHeap()
    fired: list[int] = []
    timers = []
    live: dict[int, float] = {}
    for op, arg in program:
        if op == "add":
            i = len(timers)
            timers.append(heap.call_at(arg, lambda i=i: fired.append(i)))
            live[i] = arg
        elif op == "cancel" and timers:
            i = int(arg) % len(timers)
            heap.cancel(timers[i])
            live.pop(i, None)
        elif op == "run":
            before = len(fired)
            heap.run_due(arg)
            due = sorted((d, i) for i, d in live.items() if d <= arg)
            assert [i for _, i in due] == fired[before:]
            for _, i in due:
                del live[i]
        assert len(heap) == len(live)
        delay = heap.next_delay(0.0)
        assert (delay is None) == (not live)
        if live:
            assert delay == min(live.values())


def test_len_read_from_another_thread_is_never_negative() -> None:
    heap = TimerHeap()
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(heap.__len__())  # len() itself would raise on a negative value
        except BaseException as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(e)

    thread = threading.Thread(target=reader)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between bytecodes as often as CPython allows
    thread.start()
    try:
        for round_ in range(2000):
            # Rounds alternate between few cancels (they stay in the heap until popped: the
            # moment between a pop and its bookkeeping is where a difference went negative) and
            # many (the heap is rebuilt).
            timers = [heap.call_at(float(i), lambda: None) for i in range(40 if round_ % 2 else 200)]
            for t in timers[round_ % 2 :: 1 + round_ % 2]:
                heap.cancel(t)
            heap.next_delay(0.0)
            heap.run_due(1000.0 + round_)
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join()
    assert not errors
    assert seen and min(seen) >= 0
    assert len(heap) == 0
