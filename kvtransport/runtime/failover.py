"""Failover: a transfer whose driver failed goes again over another lane of its connection.

When a batch of a sending transfer fails for a reason of its data path (an engine error: a
rail down, a NIC reset, an engine that gave up) while the control channel lives, the protocol
hands it here (:class:`~kvtransport.runtime.actions.FailOver`) instead of failing it. The
sender then:

1. takes the failed lane out of the connection (``Lane.fail_over``) and tells the receiver,
   once per failure, with a "lane_down" naming the lane's generation;
2. stops what is left of the transfer's batches on that lane (best effort: the receiver's
   fence is the guarantee) and submits every part of it sent so far again (a whole transfer,
   a chunked send's chunks, a layer-wise send's groups), in order, over the lane
   :meth:`Session.failover_target` names, where its later parts follow; and does the same for
   the connection's other transfers still on the failed lane. Their "done" goes on the control
   channel, after the "lane_down", never on the express stream.

The receiver, on "lane_down", fences the failed lane's driver for this peer (``fence``: no byte
the peer wrote through it can land any more) and holds back every "done" of this connection
until it did: a late write of the failed path must not land in pages a serving engine already
took back (the same bytes would, but decode appends into a request's last page and the prefill
reuses its source pages). A fence that does not come within the drain timeout ends the session
(its own fence then holds the failed transfers' pages as for any lost peer).

The failed lane is quarantined, not lost: once it is fenced there, and after a back-off
(``Timeouts.quarantine``, doubled at each failure in a row), the connection's initiator (alone:
two offers never cross) fences its own receive side of the failed generation if it has not
yet, makes a new one and offers the lane back ("lane_reopen"); the acceptor fences its side if
it has not yet, makes a new receive side too, connects to the offered one and answers with its
own ("lane_reopened"). Each
generation's receive sides are new ones, under driver keys of their own
(:func:`~kvtransport.runtime.lane.generation_key`): a late write of a failed generation lands
nowhere. The lane is then on probation (``Lane.probation``): one transfer at a time probes it,
and once a batch of it finished every transfer may take it again; a probe that fails fails over
like any transfer, and the back-off doubles. Two-sided lanes stay out (their notices name no
generation).

A stall is a failure too (:meth:`Failover._check`): a transfer whose lane finished nothing for
longer than its limit since its latest part was handed over. I/O thread only, but for the
submissions, which run on the lane's runner like any other.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtransport.runtime.handles import SEND, Transfer
from kvtransport.runtime.lane import generation_key
from kvtransport.runtime.peer_protocol import PeerProtocol, can_move
from kvtransport.spi.errors import DriverError, KVTransportError, ProtocolError

if TYPE_CHECKING:
    from kvtransport.runtime.actions import Action
    from kvtransport.runtime.config import Timeouts
    from kvtransport.runtime.driver_side import SessionDrivers
    from kvtransport.runtime.lane import Lane
    from kvtransport.runtime.metrics import Metrics
    from kvtransport.runtime.timers import Timer, TimerHeap
    from kvtransport.runtime.wire import Message
    from kvtransport.spi.memory import RegionSet
    from kvtransport.spi.plan import Runs

log = logging.getLogger(__name__)

#: The receiver asks the failed lane's driver to fence the peer this often, doubling, up to
#: FENCE_RETRY_MAX_S, for at most the drain timeout.
FENCE_RETRY_FIRST_S = 0.02
FENCE_RETRY_MAX_S = 1.0
#: A move waits this long for a caller thread handing over a part of the transfer.
RESUBMIT_RETRY_S = 0.001
#: The quarantine's back-off (``Timeouts.quarantine`` for a lane's first failure in a row,
#: doubled at each further one) stops growing here; a lane back and proven for FORGIVE_S
#: starts its next quarantine from the first back-off again.
QUARANTINE_MAX_S = 60.0
FORGIVE_S = 300.0
#: The acceptor refuses an offer to take a lane back sooner than this after it failed there,
#: doubled at each failure in a row up to QUARANTINE_MAX_S (a peer cycling a lane down and back
#: would make it build receive sides, and fence them, without pause).
REOPEN_MIN_INTERVAL_S = 0.25
#: A transfer's stall limit is at least this many times the time it should take: at
#: the rate its lane showed on this connection, else by the lane's measured cost model; and at
#: least the stall timeout (``Timeouts.stall``). A lane with neither (no transfer done on it
#: yet, only a nominal estimate, which may be far off) is judged by the transfer timeout.
STALL_FACTOR = 4.0


class FailoverEndpoint(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def timeouts(self) -> Timeouts: ...


class FailoverOwner(Protocol):
    """What failover reads and does of its session (``runtime.session.Session``)."""

    @property
    def id(self) -> str: ...
    @property
    def peer_label(self) -> str: ...
    @property
    def endpoint(self) -> FailoverEndpoint: ...
    @property
    def protocol(self) -> PeerProtocol: ...
    @property
    def drivers(self) -> SessionDrivers: ...
    @property
    def timers(self) -> TimerHeap: ...
    @property
    def closed(self) -> bool: ...
    @property
    def lanes(self) -> Mapping[str, Lane]: ...
    def lane_named(self, name: str) -> Lane | None: ...
    def failover_target(self, failed: Lane) -> Lane | None: ...
    def wire_name(self, driver: str) -> str: ...
    @property
    def initiator(self) -> bool: ...
    @property
    def receive_infos(self) -> dict[str, bytes]: ...
    @property
    def peer_regions(self) -> RegionSet | None: ...
    def peer_endpoint_info(self, driver: str) -> bytes: ...
    def check_lane_identity(self, driver: str, info: bytes) -> None: ...
    def send(self, kind: str, **fields: Any) -> bool: ...
    def submit_part(
        self,
        transfer: Transfer,
        runs: Runs,
        last: bool,
        *,
        inline: bool = True,
        express: bool = True,
        again: bool = False,
    ) -> int: ...
    def abort(
        self,
        transfer: Transfer,
        reason: str,
        *,
        notify: bool,
        local: bool = False,
        error: KVTransportError | None = None,
        by_peer: bool = False,
    ) -> None: ...
    def fail(self, error: KVTransportError) -> None: ...
    def run(self, actions: list[Action]) -> None: ...
    def slices_done(self, transfer: Transfer | None = None, bid: int = 0) -> None: ...


@dataclass
class _Offer:
    """This side's offer to take a lane back: its generation and the driver key of the receive
    side made for it (``info``: what the peer got; ``None`` until sent)."""

    gen: int
    key: str
    info: bytes | None = None
    #: The timer that gives up on the peer's answer, then on this side's connect.
    timer: Timer | None = None
    #: The peer took it; this side's driver connects to the peer's new receive side.
    connecting: bool = False


class Failover:
    """One session's failovers: the sender's moves and the receiver's fences of failed lanes,
    and both sides' quarantine of a failed lane until it comes back."""

    def __init__(self, session: FailoverOwner) -> None:
        self._session = session
        #: Sender: lanes it declared down to the peer ("lane_down"), in order.
        self.failed_lanes: list[str] = []
        #: Sender: the stall check's timer, while transfers are in flight.
        self._watch: Timer | None = None
        #: Receiver: lanes the peer said failed, being fenced (each with the timer that ends
        #: the connection if its fence does not come in time), and those fenced for good.
        self.fencing: dict[str, Timer] = {}
        self.fenced: set[str] = set()
        #: Receiver: "done" and "drained" messages held while a fence is under way, by tag, with
        #: the transfer each was for (one per receiving transfer: bounded by its tables).
        self._held_done: dict[str, tuple[Transfer, Message]] = {}
        self._held_drained: dict[str, Message] = {}
        #: Either side: failed lanes' timers to come back (one per lane), this side's offers
        #: under way (one per lane), and the numbers of the driver keys it made.
        self._reopen_timers: dict[str, Timer] = {}
        self.reopening: dict[str, _Offer] = {}
        #: Acceptor: the generation of the initiator's offer being answered, by lane (negated
        #: once refused as too late while its steps still hold the driver's thread).
        self.accepting: dict[str, int] = {}
        #: Initiator: the last offer it gave up waiting for an answer to, by lane.
        self._given_up: dict[str, int] = {}
        self._keys = itertools.count(1)

    # -- sender --------------------------------------------------------------------------------

    def transfer_failed(self, transfer: Transfer, old: Lane, new: Lane, error: KVTransportError) -> None:
        """``transfer``'s batch on ``old`` failed with ``error``: move it to ``new``, with every
        other transfer still on ``old``."""
        s = self._session
        moving = [transfer]
        if transfer.lane_gen != old.gen:
            # A batch of an earlier generation of the lane (its key disconnected when the lane
            # came back): the transfer moves, the lane as it is now did not fail.
            self._move(transfer, old, new, error)
            return
        old.fail_over()
        if old.name not in self.failed_lanes:
            self.failed_lanes.append(old.name)
            self._count_failure(old)
            log.warning(
                "%s: %s failed for %s (%s); its transfers go again over %s, and it is quarantined",
                s.endpoint.name,
                old.name,
                s.peer_label,
                error,
                new.name,
            )
            s.endpoint.metrics.failed_over(old.name, new.name)
            # Before any "done" of a moved transfer: in ordered mode both go on the stream, else
            # both on the control channel (a moved transfer's "done" never goes express).
            s.send("lane_down", lane=s.wire_name(old.name), gen=old.gen, reason=str(error)[:500])
            self._quarantine(old)
            moving += [
                t
                for t in s.protocol.transfers.values()
                if t is not transfer and t.role == SEND and t.lane is old and can_move(t)
            ]
        for t in moving:
            self._move(t, old, new, error)

    def _move(self, t: Transfer, old: Lane, new: Lane, error: KVTransportError) -> None:
        s = self._session
        with t.express_lock:
            if t.done_sent or t.state.final:
                return  # its one batch finished and its "done" went out: it succeeds as it is
            t.moved = True  # no "done" of the old lane's batch goes out on the express stream now
        t.failovers += 1
        t.failed_over_at = time.monotonic()
        t.failed_over_from = t.failed_over_from or old.name
        # The old lane's batches no longer count (their news is ignored from now on), nor
        # their bytes; the transfer is not done until the new lane's batches are.
        t.batches = set()
        t.bytes = 0
        t.last_sent = False
        # Until the move has its plan lock, the old lane's parts count for nothing (else their
        # news would count their bytes, and their failure move the transfer a second time).
        t.moving_to = new
        s.drivers.stop_lane(old, t)
        s.slices_done(t)  # its slices waiting on the old lane go with the move
        log.info(
            "%s: transfer %r to %s moves from %s to %s (%s)",
            s.endpoint.name,
            t.tag,
            s.peer_label,
            old.name,
            new.name,
            error,
        )
        self._resubmit(t, new)

    def _resubmit(self, t: Transfer, new: Lane) -> None:
        """Every part of ``t`` sent so far, again, in order, over ``new``; its later parts follow
        there. Under the lock the caller's threads plan parts under (so a part is either among
        those sent again or planned for the new lane), taken without waiting: a caller holding
        it (a part being handed over on its thread) is waited for through the timers, never by
        blocking the I/O thread."""
        s = self._session
        if s.closed or t.state.final or t.moving_to is not new:
            return  # ended, or moved on again meanwhile
        if not t.plan_lock.acquire(blocking=False):
            s.timers.call_later(RESUBMIT_RETRY_S, lambda: self._resubmit(t, new))
            return
        failed: KVTransportError | None = None
        try:
            t.lane = new
            t.lane_gen = new.gen
            t.moving_to = None
            t.driver = new.name
            t.raw_predicted_s = 0.0  # a moved transfer's time says nothing of either lane
            for runs, last in list(t.sent_parts):
                s.submit_part(t, runs, last, inline=False, express=False, again=True)
        except KVTransportError as exc:
            failed = exc
        finally:
            t.plan_lock.release()
        if failed is not None:
            s.abort(t, f"failing over to {new.name}: {failed}", notify=True, error=failed)

    def watch(self) -> None:
        """A batch of a sending transfer reached its driver: check, while any is in flight,
        that the lanes carrying transfers finish batches (:meth:`_check`)."""
        s = self._session
        if self._watch is None and len(s.lanes) > 1 and not s.closed:
            self._watch = s.timers.call_later(self._period(), self._check)

    def _period(self) -> float:
        return max(0.02, self._session.endpoint.timeouts.stall / 4)

    def _check(self) -> None:
        """A transfer in flight whose lane finished no batch, since the transfer's latest part
        was handed over, for longer than its limit has failed there: its batch fails as a
        driver error would (``PeerProtocol.batch_failed``), and so it fails over. Only where
        another lane is usable: without one it waits for the transfer timeout, as ever."""
        self._watch = None
        s = self._session
        if s.closed or s.protocol.closing:
            return
        now = time.monotonic()
        waiting = [
            t
            for t in s.protocol.transfers.values()
            if t.role == SEND and t.lane is not None and t.batches and can_move(t)
        ]
        # What each lane has in flight for this connection: a burst served together finishes
        # its first batch only after most of the burst's bytes moved.
        in_flight: dict[str, tuple[int, int]] = {}
        for t in waiting:
            assert t.lane is not None
            nbytes, count = in_flight.get(t.lane.name, (0, 0))
            parts = list(t.sent_parts)
            in_flight[t.lane.name] = (
                nbytes + sum(r.total_bytes for r, _ in parts),
                count + sum(len(r) for r, _ in parts),
            )
        for t in waiting:
            lane = t.lane
            if lane is None or not t.batches or t.state.final or lane.broken:
                continue  # moved or ended by an earlier one of this pass
            # From the later of its latest part's submission and its lane's latest completion:
            # a layer-wise send waiting for its next layers is not a stalled lane.
            since = max(t.last_part_at, t.failed_over_at, lane.last_progress)
            limit = self._limit(lane, *in_flight[lane.name])
            if now - since <= limit or s.failover_target(lane) is None:
                continue
            error = DriverError(
                f"{lane.name}: no batch finished for {now - since:.2f} s while {t.tag!r} waited (stall limit "
                f"{limit:.2f} s: KVTRANSPORT_STALL_TIMEOUT, or {STALL_FACTOR:g}x the time of what it had in flight "
                "at the lane's rate)"
            )
            s.run(s.protocol.batch_failed(t, next(iter(t.batches)), error))
        if waiting and not s.closed:
            self._watch = s.timers.call_later(self._period(), self._check)

    def _limit(self, lane: Lane, nbytes: int, count: int) -> float:
        """How long ``lane`` may finish nothing while it has ``nbytes`` in ``count``
        descriptors of this connection's transfers in flight."""
        timeouts = self._session.endpoint.timeouts
        expected = lane.observed_seconds(nbytes)
        if not expected and lane.models and not lane.learning:
            expected = lane.predict(count, nbytes)  # a calibrated model
        if not expected:
            return timeouts.transfer
        return max(timeouts.stall, STALL_FACTOR * expected)

    # -- receiver ------------------------------------------------------------------------------

    def on_lane_down(self, msg: Message) -> None:
        """The peer says a lane failed: fence it for this peer before any "done" counts."""
        s = self._session
        lane = s.lane_named(msg["lane"])
        if lane is None:
            raise ProtocolError(f"lane_down names {msg['lane'][:64]!r}, not a driver of this connection")
        gen = msg["gen"]
        offer = self.reopening.get(lane.name)
        if offer is not None and offer.info is not None and gen == offer.gen:
            # The peer took this side's offer and the new generation failed there before its
            # answer came (its "lane_down" may overtake it on the ordered stream): the offer is
            # void, and the receive side offered (the lane's key) is fenced as below.
            del self.reopening[lane.name]
            s.timers.cancel(offer.timer)
            lane.gen = offer.gen
        elif gen > lane.gen:
            raise ProtocolError(f"lane_down names generation {gen} of {lane.name}, which is at {lane.gen}")
        elif gen < lane.gen or lane.name in self.fencing or lane.name in self.fenced:
            return  # said twice, or of a generation fenced already
        elif offer is not None:
            if offer.info is not None:
                return  # the offer's steps fenced this generation's receive side already
            # Its steps are still fencing it: that fence is the one below, with "done" held.
            del self.reopening[lane.name]
        self._count_failure(lane)
        lane.fail_over()  # nothing of this side goes over it either
        log.warning(
            "%s: %s says %s failed (%s); fencing it for that peer before its transfers complete",
            s.endpoint.name,
            s.peer_label,
            lane.name,
            msg["reason"][:200],
        )
        drain = s.endpoint.timeouts.drain
        # The bound holds even if the lane's driver never answers (its thread stuck in the
        # engine that failed, say).
        self.fencing[lane.name] = s.timers.call_later(drain, functools.partial(self._gave_up, lane, drain))
        self._fence(lane, FENCE_RETRY_FIRST_S)

    def hold_done(self, msg: Message) -> bool:
        """Whether the "done" ``msg`` waits for a fence (taken here then)."""
        if not self.fencing:
            return False
        t = self._session.protocol.transfers.get(msg["tag"])
        if t is None or t.role == SEND or t.state.final:
            return False  # the protocol answers it as ever (ignored, or a protocol error)
        self._held_done[msg["tag"]] = (t, msg)
        return True

    def hold_drained(self, msg: Message) -> bool:
        """Whether the "drained" ``msg`` waits for a fence (taken here then): the peer's word
        that a failed transfer's writes stopped says nothing of the lane being fenced."""
        if not self.fencing:
            return False
        protocol = self._session.protocol
        tag = msg["tag"]
        if tag not in protocol.awaiting_drain and tag not in protocol.transfers:
            return False
        self._held_drained[tag] = msg
        return True

    def muted(self, lane_name: str) -> bool:
        """Whether notices for the lane ``lane_name`` names are dropped: it failed for this
        peer (its chunks must not be copied into pages any more)."""
        lane = self._session.lane_named(lane_name)
        return lane is not None and (lane.name in self.fencing or lane.name in self.fenced)

    def _fence(self, lane: Lane, wait: float) -> None:
        s = self._session
        if s.closed or lane.name not in self.fencing:
            return

        def answered(fenced: Any, error: KVTransportError | None) -> None:
            if s.closed or lane.name not in self.fencing:
                return
            if fenced is True and error is None:
                self._fenced(lane)
            else:
                s.timers.call_later(wait, lambda: self._fence(lane, min(2 * wait, FENCE_RETRY_MAX_S)))

        try:
            lane.runner.call(functools.partial(lane.driver.fence, lane.key), answered)
        except KVTransportError as exc:
            s.fail(DriverError(f"{lane.name} failed and cannot fence {s.peer_label} ({exc}): the connection ends"))

    def _gave_up(self, lane: Lane, drain: float) -> None:
        s = self._session
        if lane.name in self.fencing and not s.closed:
            s.fail(
                DriverError(
                    f"{lane.name} failed and could not fence {s.peer_label} within {drain:g} s "
                    "(KVTRANSPORT_DRAIN_TIMEOUT): the connection ends"
                )
            )

    def _fenced(self, lane: Lane) -> None:
        s = self._session
        s.timers.cancel(self.fencing.pop(lane.name, None))
        self.fenced.add(lane.name)
        log.info(
            "%s: %s fenced for %s; its transfers go on over the other lanes", s.endpoint.name, lane.name, s.peer_label
        )
        if s.initiator and lane.name not in self._reopen_timers and lane.name not in self.reopening:
            self._quarantine(lane)  # the initiator takes every failed lane back, whichever side saw it fail
        if self.fencing:
            return
        done, self._held_done = list(self._held_done.values()), {}
        drained, self._held_drained = list(self._held_drained.values()), {}
        try:
            for t, msg in done:
                if s.closed:
                    return
                if s.protocol.transfers.get(msg["tag"]) is t:  # not a later transfer under that tag
                    s.run(s.protocol.on_done(msg))
            for msg in drained:
                if s.closed:
                    return
                s.run(s.protocol.on_drained(msg))
        except KVTransportError as exc:
            s.fail(exc)  # as the message would have when it came

    # -- quarantine ------------------------------------------------------------------------
    #
    # The connection's initiator alone takes failed lanes back (whichever side saw them fail):
    # one side offers, the other accepts, so two offers never cross. Every driver key whose
    # receive side the peer learnt of is fenced before it is forgotten; a key the peer never
    # learnt of goes back to the driver (``_dispose``).

    def _count_failure(self, lane: Lane) -> None:
        """One more failure of ``lane`` in a row (the back-off, and the acceptor's patience
        with offers, follow it); a lane proven ``FORGIVE_S`` ago starts again from one."""
        if lane.back_at and time.monotonic() - lane.back_at > FORGIVE_S:
            lane.failures = 0
        lane.failures += 1

    def _quarantine(self, lane: Lane) -> None:
        """Initiator: offer ``lane`` back to the peer after its back-off."""
        s = self._session
        first = s.endpoint.timeouts.quarantine
        if not first or lane.two_sided or s.closed or not s.initiator:
            # (a two-sided lane's notices name no generation: a late one of the failed lane
            # could reach the new one's ring; it stays out for the connection's life)
            return
        wait = min(first * 2 ** max(lane.failures - 1, 0), QUARANTINE_MAX_S)
        s.timers.cancel(self._reopen_timers.pop(lane.name, None))
        self._reopen_timers[lane.name] = s.timers.call_later(wait, functools.partial(self._reopen, lane))
        log.info(
            "%s: %s quarantined for %s: offered back in %.3g s (failure %d in a row)",
            s.endpoint.name,
            lane.name,
            s.peer_label,
            wait,
            lane.failures,
        )

    def _reopen(self, lane: Lane) -> None:
        """Initiator, the back-off passed: fence this side's receive side of the failed
        generation (the peer's writes through it can land no more), make a new one, and offer
        the lane to the peer ("lane_reopen"); it answers with its own ("lane_reopened")."""
        s = self._session
        self._reopen_timers.pop(lane.name, None)
        if s.closed or not lane.broken or lane.name in self.reopening:
            return
        if lane.name in self.fencing:
            return  # the peer's word that it failed (again): offered once that fence is done
        lane.gen_offered = gen = lane.gen_offered + 1
        offer = self.reopening[lane.name] = _Offer(gen, generation_key(s.id, next(self._keys)))
        driver, current, fence_first = lane.driver, lane.key, lane.name not in self.fenced

        def steps() -> tuple[bool, bytes | KVTransportError | None]:
            if fence_first and driver.fence(current) is not True:
                return False, None
            driver.disconnect(current)
            try:
                info: bytes = driver.receive_info(offer.key)
            except KVTransportError as exc:
                return True, exc
            return True, info

        def made(result: Any, error: KVTransportError | None) -> None:
            fenced, info = result if isinstance(result, tuple) else (False, error)
            if fenced and lane.key == current and lane.name not in self.fencing:
                self.fenced.add(lane.name)  # this side's receive side of ``current``
            if self.reopening.get(lane.name) is not offer or s.closed:
                self._dispose(lane, offer.key)  # void (the peer's "lane_down" came), or the end came
                return
            if not isinstance(info, bytes):
                del self.reopening[lane.name]
                self._dispose(lane, offer.key)
                why = f"its driver failed: {info}" if info is not None else "its receive side cannot be fenced yet"
                self._not_back(lane, why)
                return
            # From here the peer may write through the new receive side: it is the lane's, and
            # the next fence (a refusal, the session's end) is of it.
            lane.key = offer.key
            self.fenced.discard(lane.name)
            offer.info = info
            if info:
                s.receive_infos[lane.name] = info  # (the core's mirror check knows it)
            s.send("lane_reopen", lane=s.wire_name(lane.name), gen=gen, info=info)
            # An honest peer answers within its connect timeout; one that does not is refused.
            offer.timer = s.timers.call_later(
                2 * s.endpoint.timeouts.connect, functools.partial(self._no_answer, lane, offer)
            )

        try:
            lane.runner.call(steps, made)
        except KVTransportError:
            del self.reopening[lane.name]  # the driver is closing with its endpoint

    def _no_answer(self, lane: Lane, offer: _Offer) -> None:
        if self.reopening.get(lane.name) is offer and not offer.connecting:
            del self.reopening[lane.name]
            self._given_up[lane.name] = offer.gen
            self._not_back(lane, f"{self._session.peer_label} did not answer the offer")

    def on_lane_reopen(self, msg: Message) -> None:
        """Acceptor: the initiator offers to take a lane back: fence this side's receive side
        of the failed generation if it is not yet, make a new one, connect to the peer's, and
        answer ("lane_reopened"), or say why not."""
        s = self._session
        lane = s.lane_named(msg["lane"])
        if lane is None:
            raise ProtocolError(f"lane_reopen names {msg['lane'][:64]!r}, not a driver of this connection")
        if s.initiator:
            raise ProtocolError("lane_reopen from the acceptor: only the connection's initiator offers lanes back")
        gen, wire = msg["gen"], s.wire_name(lane.name)
        if gen <= lane.gen_offered:
            raise ProtocolError(f"lane_reopen of {lane.name} in generation {gen}, not above {lane.gen_offered}")
        answering = self.accepting.get(lane.name)
        if answering is not None and answering > 0:
            raise ProtocolError(f"lane_reopen of {lane.name} while its previous offer is being answered")
        lane.gen_offered = gen

        def refuse(why: str) -> None:
            log.info("%s: not taking %s back for %s: %s", s.endpoint.name, lane.name, s.peer_label, why)
            s.send("lane_reopened", lane=wire, gen=gen, info=b"", reason=why[:500])

        patience = min(REOPEN_MIN_INTERVAL_S * 2 ** max(lane.failures - 1, 0), QUARANTINE_MAX_S)
        if answering is not None:
            refuse("its previous acceptance is still on the driver's thread")
        elif lane.two_sided:
            refuse("a two-sided lane is not taken back (its notices name no generation)")
        elif not s.endpoint.timeouts.quarantine:
            refuse("this side keeps failed lanes out (KVTRANSPORT_QUARANTINE=0)")
        elif not lane.broken or lane.name in self.fencing:
            refuse("it has not failed here, or its fence is still under way")
        elif time.monotonic() - lane.down_at < patience:
            refuse(f"it failed here less than {patience:g} s ago ({lane.failures} failures in a row)")
        else:
            try:
                s.check_lane_identity(lane.name, msg["info"])
            except KVTransportError as exc:
                raise ProtocolError(f"lane_reopen of {lane.name}: {exc}") from exc
            self._accept(lane, gen, msg["info"] or s.peer_endpoint_info(lane.name), refuse)

    def _accept(self, lane: Lane, gen: int, peer_info: bytes, refuse: Callable[[str], None]) -> None:
        s = self._session
        regions = s.peer_regions
        assert regions is not None  # set at the handshake, before any lane was used
        key, driver, current = generation_key(s.id, next(self._keys)), lane.driver, lane.key
        fence_first = lane.name not in self.fenced
        self.accepting[lane.name] = gen

        def steps() -> tuple[bool, bytes | KVTransportError | None]:
            if fence_first and driver.fence(current) is not True:
                return False, None
            driver.disconnect(current)  # (its receive side stays fenced)
            try:
                info: bytes = driver.receive_info(key)
                driver.connect(key, peer_info, regions)
            except KVTransportError as exc:
                return True, exc
            return True, info

        def done(result: Any, error: KVTransportError | None) -> None:
            fenced, info = result if isinstance(result, tuple) else (False, error)
            if fenced and lane.key == current:
                self.fenced.add(lane.name)
            if self.accepting.get(lane.name) == -gen:
                del self.accepting[lane.name]  # refused as too late: the next offer may come
            if self.accepting.get(lane.name) != gen or s.closed:
                self._dispose(lane, key)  # answered already (too late), or the end came: never offered
                return
            del self.accepting[lane.name]
            s.timers.cancel(timer)
            if not isinstance(info, bytes) or lane.name in self.fencing:
                self._dispose(lane, key)
                lane.failures += 1  # (the acceptor's patience grows with each failed acceptance)
                lane.down_at = time.monotonic()
                if isinstance(info, bytes):
                    refuse("the peer said it failed again while this side took it back: its fence comes first")
                else:
                    refuse(
                        f"its driver failed: {info}" if info is not None else "its receive side cannot be fenced yet"
                    )
                return
            self._back(lane, key, gen, peer_info, info)
            s.send("lane_reopened", lane=s.wire_name(lane.name), gen=gen, info=info, reason="")

        def too_late() -> None:
            if self.accepting.get(lane.name) == gen:
                self.accepting[lane.name] = -gen  # answered; its steps still hold the driver's thread
                refuse(f"its driver took longer than {s.endpoint.timeouts.connect:g} s to connect again")

        timer = s.timers.call_later(s.endpoint.timeouts.connect, too_late)
        try:
            lane.runner.call(steps, done)
        except KVTransportError as exc:  # the driver is closing with its endpoint
            done(None, exc)

    def on_lane_reopened(self, msg: Message) -> None:
        """Initiator: the peer's answer to this side's offer: connect to its new receive side
        and take the lane back on probation, or quarantine it again."""
        s = self._session
        lane = s.lane_named(msg["lane"])
        if lane is None or not s.initiator:
            raise ProtocolError(f"lane_reopened of {msg['lane'][:64]!r}: no offer of this side to answer")
        gen = msg["gen"]
        offer = self.reopening.get(lane.name)
        if offer is None or offer.info is None or offer.gen != gen:
            if gen > lane.gen_offered:
                raise ProtocolError(f"lane_reopened of {lane.name} in generation {gen}, which was never offered")
            if not msg["reason"] and self._given_up.get(lane.name) == gen and gen > lane.gen:
                # Taken by the peer after this side gave up on its answer: the peer must take it
                # out again (and fence it); this side's receive side of it is the lane's key,
                # fenced by the next offer first.
                lane.gen = gen
                s.send("lane_down", lane=s.wire_name(lane.name), gen=gen, reason="its answer came too late")
            return  # an offer voided meanwhile (the peer's "lane_down" came first), or given up on
        s.timers.cancel(offer.timer)
        if msg["reason"]:
            del self.reopening[lane.name]
            self._not_back(lane, f"{s.peer_label} did not take it back: {msg['reason'][:200]}")
            return
        try:
            s.check_lane_identity(lane.name, msg["info"])
        except KVTransportError as exc:
            del self.reopening[lane.name]
            self._not_back(lane, f"{s.peer_label} presented a receive side that is not its own")
            raise ProtocolError(f"lane_reopened of {lane.name}: {exc}") from exc
        lane.gen = offer.gen  # the peer uses this generation from now on (its "lane_down" names it)
        offer.connecting = True
        peer_info = msg["info"] or s.peer_endpoint_info(lane.name)
        regions, driver, wire = s.peer_regions, lane.driver, s.wire_name(lane.name)
        assert regions is not None  # set at the handshake, before any lane was used

        def done(_: Any, error: KVTransportError | None) -> None:
            if s.closed or self.reopening.get(lane.name) is not offer:
                return  # the end came (it fences lane.key), or the peer's "lane_down" voided it (fenced)
            del self.reopening[lane.name]
            s.timers.cancel(offer.timer)
            if error is not None:
                # The peer took it back: it must take it out again; this side's new receive
                # side (the lane's key) is fenced by the next offer first.
                s.send("lane_down", lane=wire, gen=offer.gen, reason=f"could not connect again: {error}"[:500])
                self._not_back(lane, f"its driver could not connect again: {error}")
                return
            self._back(lane, offer.key, offer.gen, peer_info, None)

        def too_late() -> None:
            done(None, DriverError(f"connect took longer than {s.endpoint.timeouts.connect:g} s"))

        offer.timer = s.timers.call_later(s.endpoint.timeouts.connect, too_late)
        try:
            lane.runner.call(functools.partial(driver.connect, offer.key, peer_info, regions), done)
        except KVTransportError as exc:  # the driver is closing with its endpoint
            done(None, exc)

    def _back(self, lane: Lane, key: str, gen: int, peer_info: bytes, own_info: bytes | None) -> None:
        s = self._session
        lane.back(key, gen, peer_info)
        self.fenced.discard(lane.name)
        s.timers.cancel(self._reopen_timers.pop(lane.name, None))
        if lane.name in self.failed_lanes:
            self.failed_lanes.remove(lane.name)
        if own_info:
            s.receive_infos[lane.name] = own_info  # (the core's mirror check knows it)
        log.info(
            "%s: %s is back for %s (generation %d), on probation: the next transfer on it probes it",
            s.endpoint.name,
            lane.name,
            s.peer_label,
            gen,
        )

    def proven(self, lane: Lane) -> None:
        """A batch of the transfer probing ``lane`` finished: it carries transfers again."""
        s = self._session
        lane.proven()
        lane.back_at = time.monotonic()  # forgiven FORGIVE_S from now, if it holds
        s.endpoint.metrics.lane_back(lane.name)
        log.info("%s: %s passed its probe for %s and carries transfers again", s.endpoint.name, lane.name, s.peer_label)

    def _not_back(self, lane: Lane, why: str) -> None:
        s = self._session
        lane.failures += 1
        log.info("%s: %s stays quarantined for %s: %s", s.endpoint.name, lane.name, s.peer_label, why)
        self._quarantine(lane)

    def _dispose(self, lane: Lane, key: str) -> None:
        """Forget the driver key ``key``, whose receive side the peer never learnt of (it goes
        back to the driver's spares)."""
        try:
            lane.runner.call(functools.partial(lane.driver.disconnect, key))
        except KVTransportError:
            pass  # the driver is closing with its endpoint: its close() releases it

    def close(self) -> None:
        """The session ended: its timers go."""
        s = self._session
        s.timers.cancel(self._watch)
        self._watch = None
        for timer in self._reopen_timers.values():
            s.timers.cancel(timer)
        self._reopen_timers.clear()
        for name, offer in self.reopening.items():
            s.timers.cancel(offer.timer)
            lane = s.lanes.get(name)
            if lane is not None and lane.key != offer.key:
                self._dispose(lane, offer.key)  # never offered (lane.key's is fenced by the end)
        self.reopening.clear()
        self.accepting.clear()  # (each answer that comes disposes its key)
        for timer in self.fencing.values():
            s.timers.cancel(timer)
        self.fencing.clear()
        self._held_done.clear()
        self._held_drained.clear()
