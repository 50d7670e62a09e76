"""What a session asks of its drivers, and on which thread.

:class:`SessionDrivers` carries out, for one session, every call into its lanes' drivers: submit
a batch and watch it to the end (and, for a one-batch transfer, send its "done" from the thread
that saw it finish), stop an aborted transfer's writes and wait until they settled, tell the
two-sided drivers a transfer is coming, hand them the peer's notices, and wait until their
inbound work from the peer is idle. Each call runs on the lane's runner thread or, when the
driver allows it and is idle, right on the calling thread (``runtime.runner``); its outcome
reaches the I/O thread as a callback. The protocol decisions that lead to these calls are the
session's machine's (``runtime.peer_protocol``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from kvtransport.runtime.handles import Transfer
from kvtransport.runtime.wire import Done
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import DriverError, KVTransportError, ProtocolError
from kvtransport.spi.plan import Runs

if TYPE_CHECKING:
    from kvtransport.runtime.config import Limits, Timeouts
    from kvtransport.runtime.express_link import ExpressLink
    from kvtransport.runtime.lane import Lane
    from kvtransport.runtime.ordered import OrderedStream
    from kvtransport.runtime.timers import TimerHeap

log = logging.getLogger(__name__)

#: Longest a receive transfer's announcement waits for a busy driver's ``expecting`` (see
#: ``SessionDrivers.expecting``): about what the credit round trip it saves costs a small transfer.
EXPECTING_WAIT_S = 0.002

#: Largest batch whose caller keeps checking it for ``Limits.inline_wait_us`` after submitting
#: it (``call_here``): at the host engines' >= 1 GB/s a bigger one takes longer than the wait,
#: and a driver may hand a batch of many descriptors to a worker thread of its own (Mooncake
#: above 64), which the caller's checks, holding the interpreter, would only hold back.
INLINE_WAIT_MAX_BYTES = 256 << 10
INLINE_WAIT_MAX_RUNS = 64
#: Largest driver notice the I/O thread hands to an idle thread-agnostic driver itself (a
#: staged chunk notice of up to about 256 pieces); larger ones go through the runner.
INLINE_NOTICE_MAX_BYTES = 8 << 10

#: Unique keys for the runner's settle watches (an object's id can be reused once it is gone).
_SETTLE_IDS = itertools.count()

Outcome = Callable[[KVTransportError | None], None]


class DriversOwner(Protocol):
    """What the driver calls need of their session."""

    id: str
    express: ExpressLink | None

    @property
    def lanes(self) -> Mapping[str, Lane]: ...
    @property
    def order(self) -> OrderedStream: ...
    @property
    def closing(self) -> bool: ...
    @property
    def two_sided(self) -> bool: ...
    @property
    def timeouts(self) -> Timeouts: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def timers(self) -> TimerHeap: ...
    @property
    def max_message_bytes(self) -> int: ...
    def wire_name(self, driver: str) -> str: ...
    def lane_named(self, name: str) -> Lane | None: ...
    def post(self, fn: Callable[[], None]) -> None:
        """Any thread: queue ``fn`` for the I/O thread."""

    def batch_finished(self, transfer: Transfer, bid: int, error: KVTransportError | None) -> None:
        """I/O thread: batch ``bid`` of ``transfer`` finished (or failed)."""

    def fail(self, error: KVTransportError) -> None:
        """I/O thread: end the session (a driver found the peer's data unusable)."""


class SessionDrivers:
    """One session's calls into its drivers (module docstring)."""

    def __init__(self, owner: DriversOwner) -> None:
        self._owner = owner
        #: A driver notice of this session failed on the driver's thread (its end is queued).
        self.notice_failed = False

    # -- I/O thread ----------------------------------------------------------------------------

    def expecting(self, transfer: Transfer, nbytes: int, then: Callable[[], None], heard: Callable[[], None]) -> None:
        """Tell each two-sided driver that ``transfer`` (``nbytes``) is coming, then ``heard()``
        (on this thread, once the idle drivers heard), then ``then()`` (the announcement). The
        staged drivers lend ring slots ahead; what a driver sends then should reach the peer
        before the announcement, or the sender, answered at once, finds no credit and pays a
        round trip for one. So a driver whose thread is busy hears of it there, and the
        announcement waits for it, but at most ``EXPECTING_WAIT_S``: that thread may be busy
        for long (another peer's ``connect``), and a lend that comes later only costs the round
        trip it was meant to save."""
        owner = self._owner

        def warn_if_failed(lane: Lane, error: KVTransportError | None) -> None:
            if error is not None:
                log.warning("%s: expecting() failed (a hint; the transfer goes on): %s", lane.name, error)

        busy: list[Lane] = []
        for lane in owner.lanes.values():
            if not lane.two_sided or type(lane.driver).expecting is KVTransport.expecting:
                continue  # nothing to hear (the SPI's default does nothing): no need to wait
            ran, _, error = lane.runner.try_here(functools.partial(lane.driver.expecting, lane.key, nbytes))
            if ran:
                warn_if_failed(lane, error)
            else:
                busy.append(lane)
        heard()
        if not busy:
            then()
            return
        timers = owner.timers
        sent = [False]

        def announce_once(_: KVTransportError | None = None) -> None:
            if not sent[0]:  # the timer or the last driver, whichever comes first
                sent[0] = True
                timers.cancel(timer)
                then()

        timer = timers.call_later(EXPECTING_WAIT_S, announce_once)
        countdown = Countdown(len(busy), announce_once)

        def one_heard(lane: Lane, _: Any, error: KVTransportError | None) -> None:
            warn_if_failed(lane, error)
            countdown.one(None)

        for lane in busy:
            try:
                lane.runner.call(
                    functools.partial(lane.driver.expecting, lane.key, nbytes), functools.partial(one_heard, lane)
                )
            except KVTransportError:
                countdown.one(None)  # the driver is closed; nothing to get ready

    def stop_writes(self, transfer: Transfer, then: Outcome) -> None:
        """Stop every batch of sending ``transfer`` on its lane (on every lane before its first
        chunk picked one: the caller may be picking one now); ``then(first error or None)``
        once none can write any more, at once when no driver is left to ask."""
        owner = self._owner
        lanes = [transfer.lane] if transfer.lane is not None else list(owner.lanes.values())
        countdown = Countdown(len(lanes), then)
        queued = False
        for lane in lanes:
            try:
                lane.runner.call(functools.partial(self._abort_on, lane, transfer, countdown.one))
                queued = True
            except KVTransportError as exc:  # the driver is closed: its close() drained it
                countdown.count -= 1
                log.debug("abort of %r on %s not queued: %s", transfer.tag, lane.name, exc)
        if not queued:
            then(None)

    def stop_lane(self, lane: Lane, transfer: Transfer) -> None:
        """Stop ``transfer``'s batches on ``lane`` alone, which failed (``runtime.failover``):
        it goes on over another lane. Best effort, logged: the receiver fences that lane."""

        def stopped(error: KVTransportError | None) -> None:
            if error is not None:
                log.debug("batches of %r on the failed lane %s: %s", transfer.tag, lane.name, error)

        try:
            lane.runner.call(functools.partial(self._abort_on, lane, transfer, stopped, stop_transfer=False))
        except KVTransportError as exc:  # the driver is closed: its close() drained it
            log.debug("abort of %r on %s not queued: %s", transfer.tag, lane.name, exc)

    def after_inbound(self, t: Transfer, kind: str, then: Outcome) -> None:
        """``then(first error or None)`` once every two-sided lane's inbound work from this
        peer is idle (at once when there is none). Every lane, not the one the peer names: its
        word on which driver moved a transfer's bytes is not trusted with our pages."""
        sided = [x for x in self._owner.lanes.values() if x.two_sided]
        if not sided:
            then(None)
            return
        countdown = Countdown(len(sided), then)
        for x in sided:
            peer = x.key
            # Idle already (the usual case for a small transfer: the driver copied its chunks
            # in on this thread as their notices came): answered in this pass, with no trip
            # through the driver's thread and back through the I/O thread's queue. Not once a
            # notice failed on the driver's thread: that failure is queued for this thread, and
            # the answer must come after it, as it does through the queue. Queued behind the
            # notices that came before (or run right here when the driver is idle, so has seen
            # all of them), so no check can answer before its driver has seen all of them.
            if not self.notice_failed:
                ran, idle, error = x.runner.try_here(functools.partial(x.driver.inbound_idle, peer))
                if ran and (idle or error is not None):
                    countdown.one(error)
                    continue
            try:
                x.runner.call_here(functools.partial(self._watch_idle, kind, x, t, countdown.one))
            except KVTransportError:
                countdown.one(None)  # the driver is closed: none of its copies runs any more

    def take_notice(self, lane_name: str, payload: bytes) -> None:
        """A driver notice from the peer for the two-sided driver ``lane_name`` names (a
        "notice" message, or one that rode in a "done")."""
        owner = self._owner
        lane = owner.lane_named(lane_name)
        if lane is None or not lane.two_sided:
            raise ProtocolError(f"notice for {lane_name[:64] or '?'!r}, not a two-sided driver of this connection")
        driver, peer = lane.driver, lane.key
        # A small notice right here when the driver allows it and is idle: a small chunk's
        # copy-in then costs no thread wake-up, and the "done" behind it finds the driver idle
        # too. A large one (many pieces to check) goes to the runner, off the I/O thread.
        if len(payload) <= INLINE_NOTICE_MAX_BYTES:
            ran, _, error = lane.runner.try_here(functools.partial(driver.on_notice, peer, payload))
            if ran:
                if error is not None:
                    owner.fail(error)
                return

        def on_runner() -> None:
            try:
                driver.on_notice(peer, payload)
            except Exception:
                # Seen by ``after_inbound`` before this failure's end (posted to the I/O
                # thread's queue) runs: a "done" read meanwhile must not find the driver idle
                # and answer Success ahead of it.
                self.notice_failed = True
                raise

        lane.runner.call(on_runner, lambda _, error: owner.fail(error) if error else None)

    # -- driver thread -------------------------------------------------------------------------

    def submit(
        self, lane: Lane, transfer: Transfer, bid: int, runs: Runs, noted: Callable[[], None], express: bool = False
    ) -> None:
        """Driver thread (or the sender's, ``call_here``): hand the batch to the driver and watch
        it. The I/O thread hears of the batch (``noted``) after the engine has it, so that no
        wake-up of the I/O thread competes with posting it, and before its result, in the
        same wake-up when the engine finished it inside ``submit``."""
        owner = self._owner
        if transfer.state.final or transfer.driver_stopped or transfer.lane is not lane:
            owner.post(noted)
            # failed or aborted before its batch got here (nothing may be written now), or moved
            # to another lane meanwhile (``runtime.failover``: this part goes again there)
            return
        if express and owner.two_sided:  # express on a two-sided session: in ordered mode
            # The notices of a batch that finishes inside ``submit`` go out with its "done".
            owner.order.hold()
            try:
                self._submit_and_watch(lane, transfer, bid, runs, noted, express)
            finally:
                owner.order.release()
        else:
            self._submit_and_watch(lane, transfer, bid, runs, noted, express)

    def _submit_and_watch(
        self, lane: Lane, transfer: Transfer, bid: int, runs: Runs, noted: Callable[[], None], express: bool
    ) -> None:
        owner = self._owner
        driver, runner = lane.driver, lane.runner
        # "done" packed ahead, all but the notices that may ride in it: before ``submit`` when
        # the driver is two-sided (a small chunk is written, and finishes, inside it), after it
        # otherwise (while the engine writes).
        ahead = express and lane.two_sided
        limit = owner.max_message_bytes
        done_message = Done(transfer.tag, runs.total_bytes, owner.wire_name(transfer.driver), limit) if ahead else None
        try:
            handle = driver.submit(lane.key, runs)
        except BaseException:
            owner.order.release()  # a notice held from inside it goes before the failure's news
            owner.post(noted)  # before the failure, which the runner posts next
            raise
        lane.handles[bid] = (handle, transfer)
        if express and done_message is None:
            done_message = Done(transfer.tag, runs.total_bytes, owner.wire_name(transfer.driver), limit)

        def check() -> bool:
            try:
                done = driver.poll(handle)
            except BaseException:
                lane.handles.pop(bid, None)
                # Some of its writes may still be finishing: the abort that follows waits for
                # them before it confirms anything to the receiver.
                lane.failed_handles.setdefault(transfer, []).append(handle)
                raise
            if done:
                lane.handles.pop(bid, None)
                if done_message is not None:
                    self.express_done(transfer, done_message)
            return done

        # A small batch's caller waits for it a little, as the engine's own callers do; not for
        # a driver that signals completion: the thread that sees the batch finish reports it,
        # and a caller checking back to back would only take the core that thread needs.
        small = runs.total_bytes <= INLINE_WAIT_MAX_BYTES and len(runs) <= INLINE_WAIT_MAX_RUNS
        signalled = type(driver).signals_completion
        wait = owner.limits.inline_wait_us * 1e-6 if small and not signalled else 0.0
        try:
            runner.watch(
                ("batch", handle),
                check,
                lambda _, error: owner.batch_finished(transfer, bid, error),
                noted,
                here_s=wait,
            )
        except BaseException:
            if lane.handles.pop(bid, None) is not None:
                # The I/O thread would not take the batch's news: nothing may go on writing
                # that nobody tracks.
                with contextlib.suppress(Exception):
                    driver.abort(handle)
            raise

    def express_done(self, transfer: Transfer, done: Done) -> None:
        """Any thread, the one that saw a one-batch transfer's batch finish (under the runner's
        claim, so no abort of it runs in the driver meanwhile): "done" straight to the peer on
        the express stream, unless the I/O thread has started failing the transfer. On a
        one-sided session the I/O thread sends it on the control channel as well (the
        protocol's progress), whether or not this one went out; in ordered mode it sends it only
        if this one did not go out."""
        owner = self._owner
        order = owner.order
        ordered = owner.two_sided
        link = order.link if ordered else owner.express
        if link is None:
            return
        with transfer.express_lock:
            if transfer.stopping or transfer.moved or transfer.state.final or owner.closing:
                if ordered:
                    order.release()  # its notices go all the same, before the news of its end
                return
            if ordered:
                transfer.done_sent = order.release(done)
            else:
                transfer.done_sent = link.send(done.encode())

    def _abort_on(self, lane: Lane, transfer: Transfer, then: Outcome, *, stop_transfer: bool = True) -> None:
        """Driver thread: stop every batch of ``transfer`` on ``lane`` (and, with
        ``stop_transfer``, submit none of it later), then watch until the driver says none of
        them can write any more, and tell the I/O thread (``then``). Gives up, without
        confirming, after the transfer timeout."""
        driver, runner = lane.driver, lane.runner
        if stop_transfer:
            transfer.driver_stopped = True
        aborted = lane.failed_handles.pop(transfer, [])
        for bid in [b for b, (_, t) in lane.handles.items() if t is transfer]:
            handle, _ = lane.handles.pop(bid)
            runner.unwatch(("batch", handle))
            try:
                driver.abort(handle)
                aborted.append(handle)
            except Exception:
                log.exception("%s: abort of batch %d failed", runner.name, handle)
        limit = self._owner.timeouts.transfer
        give_up = time.monotonic() + limit

        def quiet() -> bool:
            aborted[:] = [h for h in aborted if not driver.settled(h)]
            if aborted and time.monotonic() > give_up:
                raise DriverError(
                    f"{runner.name}: {len(aborted)} aborted batch(es) of {transfer.tag!r} still not settled after "
                    f"{limit:g} s"
                )
            return not aborted

        runner.watch(("settle", self._owner.id, next(_SETTLE_IDS)), quiet, lambda _, error: then(error))

    def _watch_idle(self, kind: str, lane: Lane, t: Transfer, then: Outcome) -> None:
        """Driver thread: ``then`` once ``lane``'s driver has no inbound work from this peer.
        ``kind`` keeps a transfer's two checks apart ("inbound": before its Success, found early
        through the driver's ``inbound_progress`` signal; "drained": after its failure)."""
        driver, peer = lane.driver, lane.key
        lane.runner.watch((kind, peer, id(t)), lambda: driver.inbound_idle(peer), lambda _, error: then(error))


class Countdown:
    """Calls ``then`` with the first error (or ``None``) once ``count`` parts answered (the
    lanes an abort or a drain check went to)."""

    def __init__(self, count: int, then: Outcome) -> None:
        self.count = count
        self.then = then
        self.error: KVTransportError | None = None

    def one(self, error: KVTransportError | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.count -= 1
        if self.count == 0:
            self.then(self.error)
