"""One endpoint's thread that waits for senders' readiness signals and acts when each fires.

A layer-wise send on GPU marks a layer ready *after* a CUDA event recorded behind the layer's
last kernel: the caller's thread (which launches the kernels) must not wait for it, or the
compute it is there to overlap would stall. The watcher takes such waits off the caller: it
holds ``(ready, then, give_up)`` watches, checks each ``ready()`` (an event's ``query()``, which
never blocks), runs ``then()`` for those that fired, and drops those whose ``give_up()`` says
nobody needs them any more (their transfer failed or timed out: every wait ends with its
transfer's own timeout). Watches are checked in a sweep over all of them, not in order: events
on different CUDA streams complete in any order.

It starts on the first watch, sleeps with no timeout while it has none, and backs off from
``SWEEP_MIN_S`` to ``SWEEP_MAX_S`` while nothing fires. At most ``max_watches`` are held; a
watch beyond that raises to its caller (the caller is marking layers faster than any GPU
completes them, or never releases them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtransport.spi.errors import KVTransportError

log = logging.getLogger(__name__)

SWEEP_MIN_S = 20e-6
SWEEP_MAX_S = 1e-3
MAX_WATCHES = 65536


class _Watch:
    __slots__ = ("give_up", "ready", "then")

    def __init__(self, ready: Callable[[], bool], then: Callable[[], None], give_up: Callable[[], bool]) -> None:
        self.ready = ready
        self.then = then
        self.give_up = give_up


class ReadinessWatcher:
    """The watcher of one endpoint (module docstring). ``watch`` from any thread; ``close`` once."""

    def __init__(self, name: str, max_watches: int = MAX_WATCHES) -> None:
        self.name = name
        self.max_watches = max_watches
        self._cv = threading.Condition()
        self._watches: list[_Watch] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        return len(self._watches)

    def watch(self, ready: Callable[[], bool], then: Callable[[], None], give_up: Callable[[], bool]) -> None:
        with self._cv:
            if self._closed:
                raise KVTransportError(f"endpoint {self.name} is closed")
            if len(self._watches) >= self.max_watches:
                raise KVTransportError(
                    f"endpoint {self.name}: {len(self._watches)} readiness signals already waited for "
                    f"(at most {self.max_watches}); are events recorded that never complete?"
                )
            self._watches.append(_Watch(ready, then, give_up))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"kvt-ready-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._watches.clear()
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        pause = SWEEP_MIN_S
        while True:
            with self._cv:
                while not self._watches and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                watches = list(self._watches)
            fired: list[_Watch] = []
            broken: list[_Watch] = []
            for w in watches:
                try:
                    if w.give_up() or w.ready():
                        fired.append(w)
                except Exception:
                    log.exception("endpoint %s: a readiness signal raised; dropping it", self.name)
                    broken.append(w)
            if fired or broken:
                with self._cv:
                    gone = {id(w) for w in (*fired, *broken)}
                    self._watches = [w for w in self._watches if id(w) not in gone]
                for w in fired:
                    if w.give_up():
                        continue
                    try:
                        w.then()
                    except Exception as exc:  # noqa: BLE001 - the stream reports its own failures
                        log.debug("endpoint %s: acting on a readiness signal failed: %s", self.name, exc)
                pause = SWEEP_MIN_S
            else:
                time.sleep(pause)
                pause = min(pause * 2, SWEEP_MAX_S)
