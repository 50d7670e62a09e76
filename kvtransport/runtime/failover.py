"""Failover: a transfer whose driver failed goes again over another lane of its connection.

When a batch of a sending transfer fails for a reason of its data path (an engine error: a
rail down, a NIC reset, an engine that gave up) while the control channel lives, the protocol
hands it here (:class:`~kvtransport.runtime.actions.FailOver`) instead of failing it. The
sender then:

1. takes the failed lane out of the connection for good (``Lane.fail_over``; the next
   connection negotiates afresh) and tells the receiver, once per lane, with a "lane_down";
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

A stall is a failure too (:meth:`Failover._check`): a transfer whose lane finished nothing for
longer than its limit since its latest part was handed over. I/O thread only, but for the
submissions, which run on the lane's runner like any other.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from kvtransport.runtime.handles import SEND, Transfer
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
    from kvtransport.spi.plan import Runs

log = logging.getLogger(__name__)

#: The receiver asks the failed lane's driver to fence the peer this often, doubling, up to
#: FENCE_RETRY_MAX_S, for at most the drain timeout.
FENCE_RETRY_FIRST_S = 0.02
FENCE_RETRY_MAX_S = 1.0
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


class Failover:
    """One session's failovers: the sender's moves and the receiver's fences of failed lanes."""

    def __init__(self, session: FailoverOwner) -> None:
        self._session = session
        #: Receiver: lanes the peer said failed, being fenced; "done" messages held meanwhile
        #: (by tag: one per receiving transfer, so bounded by the connection's transfers).
        self.fencing: set[str] = set()
        self._held: dict[str, Message] = {}
        #: Both sides: lanes failed over from, in order (for ``stats`` and the logs).
        self.failed_lanes: list[str] = []
        #: Sender: the stall check's timer, while transfers are in flight.
        self._watch: Timer | None = None

    # -- sender --------------------------------------------------------------------------------

    def transfer_failed(self, transfer: Transfer, old: Lane, new: Lane, error: KVTransportError) -> None:
        """``transfer``'s batch on ``old`` failed with ``error``: move it to ``new``, with every
        other transfer still on ``old``."""
        s = self._session
        moving = [transfer]
        if old.fail_over():
            self.failed_lanes.append(old.name)
            log.warning(
                "%s: %s failed for %s (%s); its transfers go again over %s, and it is not used again on this "
                "connection",
                s.endpoint.name,
                old.name,
                s.peer_label,
                error,
                new.name,
            )
            s.endpoint.metrics.failed_over(old.name, new.name)
            s.send("lane_down", lane=s.wire_name(old.name), reason=str(error)[:500])
            moving += [
                t
                for t in s.protocol.transfers.values()
                if t is not transfer and t.role == SEND and t.lane is old and can_move(t)
            ]
        for t in moving:
            self._move(t, old, new, error)

    def _move(self, t: Transfer, old: Lane, new: Lane, error: KVTransportError) -> None:
        s = self._session
        t.failovers += 1
        t.failed_over_at = time.monotonic()
        t.failed_over_from = t.failed_over_from or old.name
        # The old lane's batches no longer count (their news is ignored from now on), nor
        # their bytes; the transfer is not done until the new lane's batch is.
        t.batches = set()
        t.bytes = 0
        t.last_sent = False
        s.drivers.stop_lane(old, t)
        log.info(
            "%s: transfer %r to %s moves from %s to %s (%s)",
            s.endpoint.name,
            t.tag,
            s.peer_label,
            old.name,
            new.name,
            error,
        )
        try:
            # Under the lock the caller's threads plan parts under: every part planned so far
            # is in ``sent_parts`` and goes again, in order; later ones follow the new lane.
            with t.plan_lock:
                t.lane = new
                t.driver = new.name
                t.raw_predicted_s = 0.0  # a moved transfer's time says nothing of either lane
                for runs, last in list(t.sent_parts):
                    s.submit_part(t, runs, last, inline=False, express=False, again=True)
        except KVTransportError as exc:
            s.abort(t, f"failing over to {new.name}: {exc}", notify=True, error=exc)

    def watch(self) -> None:
        """A batch of a sending transfer reached its driver: check, while any is in flight,
        that the lanes carrying transfers finish batches (:meth:`_check`)."""
        s = self._session
        if self._watch is None and len(s.lanes) > 1 and not s.closed:
            self._watch = s.timers.call_later(self._period(), self._check)

    def _period(self) -> float:
        return max(0.02, self._session.endpoint.timeouts.stall / 4)

    def _check(self) -> None:
        """A transfer in flight whose lane finished no batch for longer than the
        transfer's stall limit has failed there: its batch fails as a driver error would
        (``PeerProtocol.batch_failed``), and so it fails over. Only where another lane is
        usable: without one it waits for the transfer timeout, as ever."""
        self._watch = None
        s = self._session
        if s.closed or s.protocol.closing:
            return
        now = time.monotonic()
        waiting = False
        for t in list(s.protocol.transfers.values()):
            lane = t.lane
            if t.role != SEND or lane is None or not t.batches or not can_move(t):
                continue
            waiting = True
            # From the later of its latest part's submission and its lane's latest completion:
            # a layer-wise send waiting for its next layers is not a stalled lane.
            since = max(t.last_part_at, t.failed_over_at, lane.last_progress)
            limit = self._limit(t, lane)
            if now - since <= limit or s.failover_target(lane) is None:
                continue
            error = DriverError(
                f"{lane.name}: no batch finished for {now - since:.2f} s while {t.tag!r} waited (stall limit "
                f"{limit:.2f} s: KVTRANSPORT_STALL_TIMEOUT, or {STALL_FACTOR:g}x its time at the lane's rate)"
            )
            s.run(s.protocol.batch_failed(t, next(iter(t.batches)), error))
        if waiting and not s.closed:
            self._watch = s.timers.call_later(self._period(), self._check)

    def _limit(self, t: Transfer, lane: Lane) -> float:
        """How long ``t``'s lane may finish nothing while ``t`` waits (every part of it sent so
        far counted: generous for one whose parts were already written)."""
        timeouts = self._session.endpoint.timeouts
        parts = list(t.sent_parts)
        nbytes, count = sum(r.total_bytes for r, _ in parts), sum(len(r) for r, _ in parts)
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
        if not lane.fail_over():
            return  # said twice
        self.failed_lanes.append(lane.name)
        self.fencing.add(lane.name)
        log.warning(
            "%s: %s says %s failed (%s); fencing it for that peer before its transfers complete",
            s.endpoint.name,
            s.peer_label,
            lane.name,
            msg["reason"][:200],
        )
        self._fence(lane, FENCE_RETRY_FIRST_S, time.monotonic() + s.endpoint.timeouts.drain)

    def hold(self, msg: Message) -> bool:
        """Whether the "done" ``msg`` waits for a fence (taken here then)."""
        if not self.fencing:
            return False
        t = self._session.protocol.transfers.get(msg["tag"])
        if t is None or t.role == SEND or t.state.final:
            return False  # the protocol answers it as ever (ignored, or a protocol error)
        self._held[msg["tag"]] = msg
        return True

    def _fence(self, lane: Lane, wait: float, deadline: float) -> None:
        s = self._session

        def answered(fenced: Any, error: KVTransportError | None) -> None:
            if s.closed:
                return
            if fenced is True and error is None:
                self._fenced(lane)
            elif time.monotonic() + wait > deadline:
                why = f" ({error})" if error is not None else ""
                s.fail(DriverError(f"{lane.name} failed and could not fence {s.peer_label}{why}: the connection ends"))
            else:
                s.timers.call_later(wait, lambda: self._fence(lane, min(2 * wait, FENCE_RETRY_MAX_S), deadline))

        try:
            lane.runner.call(functools.partial(lane.driver.fence, s.id), answered)
        except KVTransportError as exc:
            answered(False, exc)

    def _fenced(self, lane: Lane) -> None:
        s = self._session
        self.fencing.discard(lane.name)
        log.info(
            "%s: %s fenced for %s; its transfers go on over the other lanes", s.endpoint.name, lane.name, s.peer_label
        )
        if self.fencing:
            return
        held, self._held = list(self._held.values()), {}
        for msg in held:
            if s.closed:
                return
            s.run(s.protocol.on_done(msg))
