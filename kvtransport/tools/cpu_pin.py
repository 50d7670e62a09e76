"""CPU affinity of a whole process, for ``kvtransport bench --pin``.

On one host the bench's prefill and decode processes share its cores, which two hosts do not:
each wake-up of one process may land on a core the other just ran on, with caches cold for
it. ``--pin`` gives each process cores of its own (the prefill process the first half of the
ones this process may use, the decode process the rest), closer to the two-host case for
latency. The raw engine runs in the same two processes, so it is measured under the same
pinning.

Linux only (``os.sched_setaffinity``). Affinity is per thread there, so every thread of the
process is set, and threads started later inherit the starting thread's set.
"""

from __future__ import annotations

import os

from kvtransport.spi.errors import KVTransportError

TASKS = "/proc/self/task"


def available() -> list[int]:
    """The CPUs this process may run on, in order."""
    if not hasattr(os, "sched_getaffinity"):
        raise KVTransportError("CPU pinning needs Linux (os.sched_getaffinity)")
    return sorted(os.sched_getaffinity(0))


def split_halves(cpus: list[int]) -> tuple[list[int], list[int]]:
    """``cpus`` in two non-empty halves (the first one smaller when their count is odd)."""
    if len(cpus) < 2:
        raise KVTransportError(f"--pin needs at least 2 CPUs to give each process its own; this process may use {cpus}")
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def pin_process(cpus: list[int]) -> dict[int, set[int]]:
    """Run every thread of this process on ``cpus`` only; what each thread had before (for
    :func:`restore`)."""
    if not cpus:
        raise KVTransportError("pinning to no CPU at all")
    before: dict[int, set[int]] = {}
    for tid in _threads():
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            restore(before)  # the threads pinned so far get their CPUs back
            raise KVTransportError(f"could not pin thread {tid} to CPUs {cpus}: {exc}") from exc
    return before


def restore(before: dict[int, set[int]]) -> None:
    """Give each thread still running the CPUs it had before :func:`pin_process`; threads
    started since get the starting thread's."""
    main = before.get(os.getpid())
    for tid in _threads():
        cpus = before.get(tid, main)
        if cpus is None:
            continue
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            continue  # ended meanwhile; nothing to give back


def process_cpus() -> list[list[int]]:
    """The distinct CPU sets of this process's threads (one set when the process is pinned)."""
    sets = set()
    for tid in _threads():
        try:
            sets.add(tuple(sorted(os.sched_getaffinity(tid))))
        except OSError:
            continue
    return [list(s) for s in sorted(sets)]


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir(TASKS)]
    except OSError:
        return [os.getpid()]
