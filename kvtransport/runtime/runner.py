"""The driver thread: every call into one open driver, and completion without polling ticks.

Each open driver gets one :class:`DriverRunner`, whose thread makes every call into the driver
after ``open()`` (connect, submit, poll, abort, on_notice, inbound_idle, disconnect), so a
driver sees one call at a time and the endpoint's I/O thread never waits on an engine: a
``connect`` that takes a second stalls that driver's queue, never a heartbeat. A driver that
declares ``thread_agnostic`` also takes a call on the thread that makes it (``call_here``: a
sender's submit; the I/O thread's small notices, inbound checks and ``expecting``, none of
which may block) or signals it (``signal``: a completion), while its runner has nothing queued
or running: a thread hand-off fewer, which on a small host is most of a small request's latency.

Completion: the runner keeps *watches* (an in-flight batch, a peer's inbound work) and checks
each one when the driver signals it (``DriverContext.completed`` / ``inbound_progress``, from
any thread) and otherwise with back-off: from ``POLL_MIN_S`` doubling to ``POLL_MAX_S`` for a
driver that can only be polled, to ``SIGNALLED_POLL_MAX_S`` (a safety net) for one that
signals. With nothing in flight the thread blocks with no timeout: an idle endpoint does not
wake up. Results go back to the I/O thread through ``post``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import DriverError, EngineError, KVTransportError

log = logging.getLogger(__name__)

#: First back-off step for a polled watch, and the cap for drivers that can only be polled
#: (an engine like UCX also makes progress inside its poll call, so the cap stays short; it
#: costs a few thousand cheap calls a second, and only while something is in flight).
POLL_MIN_S = 10e-6
POLL_MAX_S = 250e-6
#: Cap for drivers that signal completion: polling is then only a safety net.
SIGNALLED_POLL_MAX_S = 50e-3
#: A polled driver's new watch is checked back to back (yielding between checks) for this long:
#: a write of a few MiB finishes within it, any sleep would cost more (Linux timer slack is 50 us),
#: and an engine like UCX moves a transfer along inside those checks (measured, nixl-ucx, 2 MiB
#: request: p50 3.2 ms with a 200 us spin, 1.8 ms with 5 ms). Only while something is in flight.
SPIN_S = 5e-3

Post = Callable[[Callable[[], None]], None]
#: ``then(result, error)``: run on the I/O thread with what a driver call returned or raised.
Then = Callable[[Any, KVTransportError | None], None]


def as_error(driver: str, exc: BaseException) -> KVTransportError:
    """A driver's exception as a kvtransport error (a bug in a driver is reported, not raised)."""
    if isinstance(exc, KVTransportError):
        return exc
    if isinstance(exc, NotImplementedError):
        return DriverError(f"{driver}: {exc or 'operation not supported'}")
    return EngineError(f"{driver}: {type(exc).__name__}: {exc}")


class _Watch:
    __slots__ = ("check", "then")

    def __init__(self, check: Callable[[], bool], then: Then) -> None:
        self.check = check
        self.then = then


def _first_then(first: Callable[[], None], then: Then) -> Then:
    def both(result: Any, error: KVTransportError | None) -> None:
        first()
        then(result, error)

    return both


class DriverRunner:
    def __init__(self, name: str, driver: KVTransport, post: Post) -> None:
        self.name = name
        self.driver = driver
        self._post = post
        self._signalled_driver = bool(getattr(driver, "signals_completion", False))
        self._cap = SIGNALLED_POLL_MAX_S if self._signalled_driver else POLL_MAX_S
        # Entered as the lock itself where no wait is needed: ``with`` on the condition adds a
        # Python-level call each way, on every request's path.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._calls: collections.deque[tuple[Callable[[], Any], Then | None]] = collections.deque()
        self._signals: set[Hashable] = set()
        self._prefixes: set[tuple[Any, ...]] = set()
        self._watches: dict[Hashable, _Watch] = {}
        self._delay = POLL_MIN_S
        self._next_check = 0.0
        self._spin_until = 0.0
        self._stop = False
        #: Set (under ``_lock``) while a thread runs driver calls: the runner's thread for what
        #: it took off the queue, or a caller running a submit in place (``call_here``).
        self._busy = False
        self._inline = bool(getattr(driver, "thread_agnostic", False))
        #: Calls run on their caller's thread (``call_here``).
        self.inline_calls = 0
        #: Times the thread woke up (an idle runner does not).
        self.wakeups = 0
        self._thread = threading.Thread(target=self._run, name=f"kvtransport-driver {name}", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------

    def call(self, fn: Callable[[], Any], then: Then | None = None) -> None:
        """Run ``fn`` on the driver thread; ``then(result, error)`` on the I/O thread after."""
        with self._lock:
            if self._stop:
                raise DriverError(f"{self.name}: the driver is closed")
            self._calls.append((fn, then))
            self._cv.notify()

    def call_here(self, fn: Callable[[], Any], then: Then | None = None) -> None:
        """Like :meth:`call`, but run ``fn`` on this thread, now, when the driver allows it
        (``thread_agnostic``) and its thread has nothing queued or running: calls stay one
        at a time and in order, and a small request skips a thread hop on its way to the
        engine. ``then`` still runs on the I/O thread."""
        with self._lock:
            if not self._claim_here():
                self.call(fn, then)  # queued (raises once the driver is closed)
                return
        try:
            self.inline_calls += 1
            self._run_call(fn, then)
        finally:
            self._release_here()

    def try_here(self, fn: Callable[[], Any]) -> tuple[bool, Any, KVTransportError | None]:
        """Run ``fn`` on this thread, now, when :meth:`call_here` would: ``(True, result,
        error)``; ``(False, None, None)`` when only the driver's thread may run it now. For a
        quick check whose answer the caller uses in the same pass, with no round trip through
        the driver's thread and the I/O thread's queue."""
        with self._lock:
            if not self._claim_here():
                return False, None, None
        try:
            self.inline_calls += 1
            return True, fn(), None
        except Exception as exc:  # noqa: BLE001 - the caller gets the typed error
            return True, None, as_error(self.name, exc)
        finally:
            self._release_here()

    def signal(self, key: Hashable) -> None:
        """The driver says watch ``key`` may have finished: check it now, on this thread when
        the driver allows it (``thread_agnostic``) and its thread is idle, else on the
        driver's thread."""
        with self._lock:
            if not self._claim_here():
                self._signals.add(key)
                self._cv.notify()
                return
        try:
            self._check_key(key)
        finally:
            self._release_here()

    def _claim_here(self) -> bool:
        """``_lock`` held: may this (non-runner) thread make driver calls now? If so it must
        call :meth:`_release_here` after them."""
        here = self._inline and not self._busy and not self._calls and not self._stop and not self.in_runner_thread()
        if here:
            self._busy = True
        return here

    def _release_here(self) -> None:
        with self._lock:
            self._busy = False
            # The thread re-reads its watches and anything queued meanwhile; woken for nothing
            # (no watch, nothing queued) it would only take the interpreter from this caller,
            # a wake-up that costs 0.05-0.3 ms on a small virtual machine.
            if self._watches or self._calls or self._signals or self._prefixes or self._stop:
                self._cv.notify()

    def signal_prefix(self, prefix: tuple[Any, ...]) -> None:
        """Check every watch whose key (a tuple) starts with ``prefix`` (none: nothing to do,
        and the driver's thread is not woken)."""
        n = len(prefix)
        with self._lock:
            # A snapshot (one C-level copy under the interpreter lock): the runner's thread ends
            # watches without ``_lock``, and iterating the dict itself while it does raised
            # "dictionary changed size during iteration" in the signalling (staging) thread.
            if self._watches and any(isinstance(k, tuple) and k[:n] == prefix for k in list(self._watches)):
                self._prefixes.add(prefix)
                self._cv.notify()

    def in_runner_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = 10.0) -> bool:
        """Run what is queued, then stop; ``True`` once the thread has ended."""
        with self._lock:
            self._stop = True
            self._cv.notify()
        if not self.in_runner_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def watching(self) -> int:
        return len(self._watches)

    # -- driver thread ---------------------------------------------------------------------

    def watch(
        self,
        key: Hashable,
        check: Callable[[], bool],
        then: Then,
        first: Callable[[], None] | None = None,
        *,
        spin: bool = True,
        here_s: float = 0.0,
    ) -> None:
        """Driver thread: check ``check()`` until it returns ``True`` or raises, then post
        ``then``. Checked once now (a batch that completed inside ``submit``). ``first`` runs
        on the I/O thread before ``then``: in the same wake-up when that first check ends it.
        ``spin=False`` for a watch that only keeps an engine moving (no batch of its own ends
        sooner for checking it back to back): back-off from the start. ``here_s``: on a
        caller's thread (``call_here``), keep checking for up to that long before the runner
        takes the watch over: a batch that finishes within it is seen with no thread wake-up,
        as the engine's own API sees it when its caller polls."""
        w = _Watch(check, then if first is None else _first_then(first, then))
        # ``first`` must reach the I/O thread: posting it raises (``ChannelDown``) rather than
        # dropping it, and the watch is not kept then.
        done = self._check(key, w, strict=first is not None)
        if not done and here_s > 0 and not self.in_runner_thread():
            # The caller holds the driver meanwhile: a call queued behind it ends the wait. No
            # yield between checks: it cost 0.08 ms a request here (mooncake-gdr, 64 KiB), and
            # the callers that wait are small batches that the engine finishes on its own threads.
            until = time.monotonic() + here_s
            while not done and not self._calls and time.monotonic() < until:
                done = self._check(key, w, strict=first is not None)
        if not done and first is not None:
            w.then = then
            self._post(first)
        if not done:
            with self._lock:  # a caller's thread may add a watch (``call_here``)
                self._watches[key] = w
                self._delay = POLL_MIN_S
                now = time.monotonic()
                self._next_check = now + self._delay
                if spin and not self._signalled_driver:
                    self._spin_until = now + SPIN_S

    def unwatch(self, key: Hashable) -> None:
        self._watches.pop(key, None)

    def _check(self, key: Hashable, w: _Watch, strict: bool = False) -> bool:
        """``True`` when the watch is over (its result posted; ``strict``: or raised, when
        the I/O thread would not take it)."""
        post = self._post_strict if strict else self._post_then
        try:
            done = bool(w.check())
        except Exception as exc:  # noqa: BLE001 - the watch's owner gets the typed error
            post(w.then, None, as_error(self.name, exc))
            return True
        if done:
            post(w.then, True, None)
        return done

    def _post_strict(self, then: Then, result: Any, error: KVTransportError | None) -> None:
        self._post(lambda: then(result, error))

    def _check_key(self, key: Hashable) -> None:
        """Check the watch ``key`` (if still watched); forget it once it is over."""
        w = self._watches.get(key)
        if w is not None and self._check(key, w):
            with self._lock:  # the runner's wait loop reads the watches under it
                self._watches.pop(key, None)
                self._delay = POLL_MIN_S

    def _check_all(self) -> bool:
        """Check every watch; ``True`` if any of them ended."""
        finished = [k for k, w in list(self._watches.items()) if self._check(k, w)]
        for k in finished:
            self._watches.pop(k, None)
        return bool(finished)

    def _post_then(self, then: Then, result: Any, error: KVTransportError | None) -> None:
        try:
            self._post(lambda: then(result, error))
        except Exception as exc:  # noqa: BLE001 - the endpoint is going away
            log.debug("%s: result not delivered: %s", self.name, exc)

    def _run(self) -> None:
        while True:
            spin = False
            with self._lock:
                while self._busy or not (self._calls or self._signals or self._prefixes or self._stop):
                    if not self._watches or self._busy:
                        self._cv.wait()
                        continue
                    now = time.monotonic()
                    if now < self._spin_until:
                        spin = True
                        break
                    wait = self._next_check - now
                    if wait <= 0:
                        break
                    self._cv.wait(wait)
                self.wakeups += 1
                if self._stop and not self._calls:
                    return
                calls, self._calls = self._calls, collections.deque()
                signals, self._signals = self._signals, set()
                prefixes, self._prefixes = self._prefixes, set()
                self._busy = True
            try:
                self._work(calls, signals, prefixes, spin)
            finally:
                with self._lock:
                    self._busy = False

    def _run_call(self, fn: Callable[[], Any], then: Then | None) -> None:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - contained to this call
            error = as_error(self.name, exc)
            if then is None:
                log.warning("%s: %s", self.name, error)
            else:
                self._post_then(then, None, error)
        except BaseException as exc:
            # An interrupt on a caller's thread (``call_here``): the call's owner still hears
            # of it, so nothing waits for a result that will not come; the caller gets it too.
            if then is not None:
                self._post_then(then, None, DriverError(f"{self.name}: interrupted: {type(exc).__name__}"))
            raise
        else:
            if then is not None:
                self._post_then(then, result, None)

    def _work(
        self,
        calls: collections.deque[tuple[Callable[[], Any], Then | None]],
        signals: set[Hashable],
        prefixes: set[tuple[Any, ...]],
        spin: bool,
    ) -> None:
        for fn, then in calls:
            self._run_call(fn, then)
        for prefix in prefixes:
            n = len(prefix)
            signals.update(k for k in list(self._watches) if isinstance(k, tuple) and k[:n] == prefix)
        for key in signals:
            self._check_key(key)
        if spin:
            time.sleep(0)  # let the engine's and the caller's threads run between checks
            self._check_all()
            return
        if self._watches and time.monotonic() >= self._next_check:
            finished = self._check_all()
            self._delay = POLL_MIN_S if finished else min(self._delay * 2, self._cap)
            self._next_check = time.monotonic() + self._delay
