"""The transfer protocol with one peer, as a state machine that does no I/O.

:class:`PeerProtocol` owns what the protocol decides for one connection: the transfers filed
under their tags, what each message from the peer means for them (``expect``, ``done``,
``abort``, ``drained``), their states and the timeout of each state, aborts (the caller's, the
peer's, a timeout's, a driver's), the pages announced to the peer (its
:class:`~kvtransport.spi.inbound.InboundGuard`) and the failed transfers that wait for the
sender's word that its writes stopped.

Events come in as method calls (a message arrived, a chunk reached its driver, a batch
finished, a timer fired, the caller aborted, the session ends); what must happen comes back as
a list of actions (``runtime.actions``), in order: send a message, set a timer, stop a
transfer's writes on the drivers, check with the two-sided drivers that their inbound work is
idle, publish a final state to waiting callers, and so on. The machine sends nothing, arms no
timer and calls no driver: the session (``runtime.session``) carries the actions out on the
endpoint's I/O thread and feeds the outcomes back as events. A test can drive it with any
sequence of events and read what it would do (tests/test_peer_protocol.py).

It reads, without calling into them, what the session learnt at handshake (:class:`PeerFacts`:
the peer's regions, the lanes and their kind, the decision) and keeps the endpoint-wide tag
book (``runtime.tags``, itself a machine that does no I/O) up to date.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from kvtransport.runtime.actions import (
    Action,
    Announce,
    Arriving,
    Calibrate,
    CheckInbound,
    EndSession,
    FailOver,
    Fence,
    FlushNotices,
    Later,
    Next,
    Observe,
    Publish,
    Send,
    SetTimer,
    StopWrites,
)
from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.checks import MALFORMED_STATE, read_announcement, well_formed_state
from kvtransport.runtime.handles import RECV, SEND, State, Transfer
from kvtransport.runtime.tags import Refused, TagBook
from kvtransport.runtime.wire import Message
from kvtransport.spi.errors import (
    DriverError,
    InvalidPages,
    KVTransportError,
    PeerLost,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from kvtransport.spi.inbound import Claim, InboundGuard
from kvtransport.spi.plan import SMALL

if TYPE_CHECKING:
    from kvtransport.negotiation.negotiate import Decision
    from kvtransport.runtime.config import Limits, Timeouts
    from kvtransport.runtime.planning import PairPlan
    from kvtransport.spi.memory import RegionSet

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"


# -- what the machine reads of its session ------------------------------------------------------


class LaneFacts(Protocol):
    """What the protocol reads of a lane: its driver's name and kind."""

    @property
    def name(self) -> str: ...
    @property
    def two_sided(self) -> bool: ...


class PeerFacts(Protocol):
    """What the handshake learnt of the peer (``runtime.session.Session`` provides it)."""

    @property
    def decision(self) -> Decision | None: ...
    @property
    def peer_regions(self) -> RegionSet | None: ...
    @property
    def lanes(self) -> Mapping[str, LaneFacts]: ...
    @property
    def plan(self) -> PairPlan: ...
    def failover_target(self, failed: Any) -> Any: ...
    def lane_failed(self, lane: Any, why: str) -> None: ...


LaneT = TypeVar("LaneT", bound=LaneFacts)


def primary_lane(lanes: Mapping[str, LaneT]) -> LaneT | None:
    """The lane of the decision's chosen driver (lanes are kept in that order)."""
    return next(iter(lanes.values()), None)


def lane_named(lanes: Mapping[str, LaneT], name: str) -> LaneT | None:
    """The lane a peer's message names ("": the chosen driver's), or ``None``."""
    return lanes.get(name) if name else primary_lane(lanes)


def wire_name(lanes: Mapping[str, LaneFacts], driver: str) -> str:
    """How this side's messages name the lane of ``driver``: "" for the chosen driver (whatever
    the length of its name), else its name."""
    primary = primary_lane(lanes)
    return "" if primary is None or primary.name == driver else driver


def done_notices(msg: Message) -> list[bytes]:
    """The driver notices that rode in a "done" (the wire's schema checked them: at most
    ``wire.MAX_DONE_NOTICES`` byte strings). They count as messages of their own just before it."""
    notices: list[bytes] = msg["notices"]
    return notices


class PeerProtocol:
    """One connection's transfers and what the protocol does with them (module docstring)."""

    def __init__(
        self,
        peer: PeerFacts,
        key: Any,
        peer_label: str,
        *,
        regions: RegionSet,
        limits: Limits,
        timeouts: Timeouts,
        tags: TagBook[Any],
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._peer = peer
        #: How the endpoint's tag book knows this connection (the session).
        self._key = key
        self.peer_label = peer_label
        self.regions = regions
        self.limits = limits
        self.timeouts = timeouts
        self.tags = tags
        self._now = now
        self.phase = Phase.HANDSHAKE
        self.error: KVTransportError | None = None
        self.transfers: dict[str, Transfer] = {}
        #: Sender: failed tags whose aborted batches may still be writing (``drained`` follows).
        #: (by tag, how many aborted transfers of it: a tag may be reused while an earlier
        #: transfer under it still settles; "drained" waits for all of them). Bounded: one
        #: entry per aborted sending transfer, each ended by its driver's answer or give-up.
        self.settling: dict[str, int] = {}
        #: Sender: settling tags one of whose aborts the driver could not confirm.
        self._unconfirmed: set[str] = set()
        #: Receiver: failed transfers whose pages were announced and whose sender has not yet
        #: confirmed its writes stopped; kept past ``retain_finished`` (bounded like early aborts).
        self.awaiting_drain: collections.OrderedDict[str, Transfer] = collections.OrderedDict()
        self.guard: InboundGuard | None = None
        #: Set when the session starts closing: no per-transfer confirmations go out then.
        self.closing = False
        #: Ordered mode: the session's ordered messages travel on its express stream (set once).
        self.ordered = False
        #: This side announced pages to the peer at least once (what a fence has to cover).
        self.announced_any = False
        self._out: list[Action] = []

    # -- facts ---------------------------------------------------------------------------------

    @property
    def two_sided(self) -> bool:
        return any(lane.two_sided for lane in self._peer.lanes.values())

    def expected_bytes(self, t: Transfer) -> int:
        """What a complete transfer writes into the pages (aux slot, state items) ``t`` announced."""
        claim = t.announced
        return 0 if claim is None else self._peer.plan.expected_bytes(claim)

    def _driver_of(self, t: Transfer, default: str) -> str:
        decision = self._peer.decision
        return t.driver or (decision.driver if decision else default)

    # -- events: this side's transfers ---------------------------------------------------------

    def announce_receiver(self, t: Transfer, claim: Claim, fields: dict[str, Any]) -> list[Action]:
        """The caller announced receive transfer ``t`` (its pages ``claim``; ``fields`` of its
        "expect"): filed, its pages guarded, then announced once its drivers heard."""
        if self._file(t):
            t.announced = claim
            self.announced_any = True
            if self.guard is None:
                self.guard = InboundGuard(self.regions)
            self.guard.add(claim)
            self._out.append(Announce(t, fields))
        return self._take()

    def arrivals_begin(self, t: Transfer) -> list[Action]:
        """Receive transfer ``t``'s drivers heard of it: its bytes may arrive from now on
        (unless it ended meanwhile: nothing of it is counted then, nothing would uncount it)."""
        if t.filed and not t.state.final:
            self._start_arriving(t)
        return self._take()

    def announcement_due(self, t: Transfer, fields: dict[str, Any]) -> list[Action]:
        if not t.state.final:  # failed or aborted before its drivers were ready: the peer heard
            self._send("expect", fields)
        return self._take()

    def register_sender(self, t: Transfer) -> list[Action]:
        """The caller created send transfer ``t``: filed, and fed the announcement that came early."""
        if self._file(t):
            early = self.tags.take_announcement(self._key, t.tag)
            if early is not None:
                self._on_expect(early)
        return self._take()

    def chunk_submitted(self, t: Transfer, bid: int, nbytes: int, last: bool) -> list[Action]:
        """A chunk reached its driver (batch ``bid``; 0 for a chunk without runs)."""
        if not t.state.final:
            self._set(t, State.TRANSFERRING)
            t.last_sent = t.last_sent or last  # (a part's "submitted" never takes it back)
            if bid:
                t.batches.add(bid)
                t.bytes += nbytes
            self._progress(t)
        return self._take()

    def batch_finished(self, t: Transfer, bid: int, error: KVTransportError | None) -> list[Action]:
        if bid in t.batches:  # else aborted meanwhile
            t.batches.discard(bid)
            if error is not None:
                self._batch_failed(t, error)
            else:
                self._progress(t)
        return self._take()

    def batch_failed(self, t: Transfer, bid: int, error: KVTransportError) -> list[Action]:
        """Batch ``bid`` could not be submitted (its "submitted" came first: the runner posts
        it ahead of the failure), or its poll failed."""
        if bid in t.batches:  # else no longer counted: aborted meanwhile, or moved to another lane
            t.batches.discard(bid)
            self._batch_failed(t, error)
        return self._take()

    def abort(
        self,
        t: Transfer,
        reason: str,
        *,
        notify: bool,
        local: bool = False,
        error: KVTransportError | None = None,
        by_peer: bool = False,
    ) -> list[Action]:
        self._abort(t, reason, notify=notify, local=local, error=error, by_peer=by_peer)
        return self._take()

    def abort_tag(self, tag: str, reason: str) -> list[Action]:
        """The caller aborted ``tag``: its transfer here, or tell the peer nothing of it is wanted."""
        t = self.transfers.get(tag)
        if t is not None:
            self._abort(t, reason, notify=True, local=True)
        elif self.phase is Phase.READY:
            self._send("abort", {"tag": tag, "reason": reason})
        return self._take()

    def writes_stopped(self, tag: str, error: KVTransportError | None) -> list[Action]:
        """The aborted batches of ``tag`` can no longer write (or the driver could not say:
        then the receiver is not told, and falls back on its own timeout)."""
        left = self.settling.get(tag, 1) - 1
        if left > 0:
            self.settling[tag] = left
        else:
            self.settling.pop(tag, None)
        if error is not None:
            log.warning("%s: cannot confirm that aborted writes of %r stopped: %s", self.peer_label, tag, error)
            self._unconfirmed.add(tag)
        if left <= 0 and tag not in self._unconfirmed:
            self._send_drained(tag)
        if left <= 0:
            self._unconfirmed.discard(tag)
        return self._take()

    def confirm_drained(self, tag: str) -> list[Action]:
        """Tell the peer nothing of ``tag`` is written any more (the application refused it),
        unless an aborted transfer under that tag may still be writing: its own "drained"
        follows once those writes stopped."""
        if tag not in self.settling:
            self._send_drained(tag)
        return self._take()

    def inbound_checked(self, t: Transfer, kind: str, error: KVTransportError | None) -> list[Action]:
        """The answer to :class:`CheckInbound`."""
        if kind == "inbound":
            if error is not None:
                # The driver found the peer's inbound data unusable (e.g. a chunk notice pointing
                # outside the announced pages): nothing from that peer can be trusted to be in place.
                self._out.append(EndSession(error, True))
            elif t.peer_done:
                self._set(t, State.SUCCESS)
        elif error is None:
            t.drained.set()
            self._stop_arriving(t)
        return self._take()

    def inbound_pending(self, t: Transfer) -> list[Action]:
        """After a "done"'s :class:`CheckInbound` ran: not answered in that pass (a driver is
        still copying in), the transfer is Transferring meanwhile. Answered at once (the usual
        case for a small transfer), it went straight to Success, as a one-sided transfer's does,
        without a state change in between."""
        if t.state is State.WAITING_FOR_INPUT and self.two_sided:
            self._set(t, State.TRANSFERRING)
        return self._take()

    def forget(self, t: Transfer) -> list[Action]:
        self._stop_arriving(t)
        if self.transfers.get(t.tag) is t:
            del self.transfers[t.tag]
            self.tags.forget_transfer(self._key, t.tag)
        t.filed = False
        return self._take()

    def expire(self, t: Transfer, state: State, limit: float) -> list[Action]:
        if t.state is state:
            self._abort(
                t,
                f"timed out in {state.name} after {limit:g} s",
                notify=True,
                error=TransferTimeout(f"transfer {t.tag!r} spent more than {limit:g} s in {state.name}"),
            )
        return self._take()

    def close(self, error: KVTransportError, *, notify: bool) -> list[Action]:
        """The session ends: every transfer fails, every table is emptied, and the drivers
        fence the peer: the receive transfers it never confirmed (``drained``) get their pages
        back once no byte of it can land any more."""
        if self.phase is Phase.CLOSED:
            return []
        self.closing = True  # the peer is gone or told "bye": no per-transfer confirmations
        for t in list(self.transfers.values()):
            self._abort(t, str(error), notify=notify, error=error)
        self.phase = Phase.CLOSED
        self.error = self.error or error
        filed = list(self.transfers)
        unconfirmed = tuple(t for t in self.awaiting_drain.values() if not t.drained.is_set())
        for t in [*self.transfers.values(), *self.awaiting_drain.values()]:
            self._out.append(SetTimer(t))
            t.filed = False
            self._stop_arriving(t)
        self.transfers.clear()
        self.awaiting_drain.clear()
        self.tags.forget(self._key, filed)  # its early tables, and every tag it owned
        self._out.append(Fence(unconfirmed, self.announced_any))
        return self._take()

    def _drain_overdue(self, t: Transfer) -> list[Action]:
        """A failed receive transfer's pages have waited ``timeouts.drain`` for the peer's word
        that its writes stopped: the session ends, so that the drivers fence the peer."""
        if self.awaiting_drain.get(t.tag) is t and not t.drained.is_set() and self.phase is Phase.READY:
            self._out.append(
                EndSession(
                    PeerLost(
                        f"peer {self.peer_label} did not confirm within {self.timeouts.drain:g} s that the writes "
                        f"of failed transfer {t.tag!r} stopped (KVTRANSPORT_DRAIN_TIMEOUT); the connection ends "
                        "so that its writes are fenced"
                    ),
                    True,
                )
            )
        return self._take()

    # -- events: the peer's messages -----------------------------------------------------------

    def on_expect(self, msg: Message) -> list[Action]:
        self._on_expect(msg)
        return self._take()

    def on_done(self, msg: Message) -> list[Action]:
        """A "done" whose notices (``done_notices``) the drivers already took."""
        t = self.transfers.get(msg["tag"])
        if t is None:
            # A transfer this side already failed and forgot (timeout, abort): a benign race.
            log.debug("done for %r from %s, which is no longer tracked", msg["tag"], self.peer_label)
            return []
        if t.role != RECV:
            raise ProtocolError(f"done for transfer {msg['tag']!r}, which this side sends")
        if t.state.final or t.peer_done:
            return []
        lane = lane_named(self._peer.lanes, msg["lane"])
        if lane is None:
            raise ProtocolError(f"done for {t.tag!r} names {msg['lane'][:64]!r}, not a driver of this connection")
        expected = self.expected_bytes(t)
        if msg["bytes"] != expected:
            raise ProtocolError(
                f"done for {t.tag!r} says {msg['bytes']} bytes were written; its announced pages hold {expected}"
            )
        t.bytes = int(msg["bytes"])
        t.peer_done = True
        t.driver = lane.name
        # Success only once every two-sided lane's inbound work for this peer has drained,
        # whichever lane "done" names: the peer could name a one-sided one while its chunks
        # are still being copied into our pages.
        return [CheckInbound(t, "inbound"), Next(lambda: self.inbound_pending(t))]

    def on_abort(self, msg: Message) -> list[Action]:
        tag, reason = msg["tag"], msg["reason"]
        t = self.transfers.get(tag)
        if t is not None:
            if t.role == SEND and t.state is State.SUCCESS:
                self._send_drained(tag)  # every write of it completed
            self._abort(
                t,
                f"aborted by peer {self.peer_label}: {reason}",
                notify=False,
                error=TransferAborted(f"transfer {t.tag!r} aborted by peer {self.peer_label}: {reason}"),
                by_peer=True,
            )
        elif not self.tags.early_abort(self._key, tag, str(reason)):
            # Only the session that announced a tag can abort it: this one never did.
            log.debug("ignoring an abort for %r from %s: another connection owns it", tag, self.peer_label)
        elif tag not in self.settling:
            self._send_drained(tag)  # this side never wrote (or no longer writes) anything of it
        return self._take()

    def on_drained(self, msg: Message) -> list[Action]:
        t = self.awaiting_drain.pop(msg["tag"], None) or self.transfers.get(msg["tag"])
        if t is None or t.role != RECV or not t.state.final:
            # Forgotten already (the engine fell back on its own timeout), ours to send, or still
            # running (a sender confirms only after the abort it sent first): nothing to learn.
            log.debug("drained for %r from %s ignored", msg["tag"], self.peer_label)
            return []
        # Copies into our pages by a two-sided driver are this side's own work: wait until
        # they are idle too.
        return [CheckInbound(t, "drained")]

    # -- the machine ---------------------------------------------------------------------------

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    def _send(self, kind: str, fields: dict[str, Any]) -> None:
        if self.phase is not Phase.CLOSED:
            self._out.append(Send(kind, fields))

    def _send_drained(self, tag: str) -> None:
        if self.phase is Phase.READY and not self.closing:
            # Notices a two-sided driver queued for this peer go first (as before "done").
            self._out.append(FlushNotices())
            self._send("drained", {"tag": tag})

    def _set(self, t: Transfer, state: State, error: KVTransportError | None = None) -> None:
        if t._set(state, error):
            self._changed(t)
            if state.final:
                t.sent_parts = []  # nothing of it is sent again (held only for a failover)
                self._out.append(Publish(t))

    def _file(self, t: Transfer) -> bool:
        """File ``t`` under its tag; fail it at once if it cannot proceed."""
        if t.tag in self.transfers:
            self._set(t, State.FAILED, KVTransportError(f"tag {t.tag!r} is already in use on this connection"))
            return False
        if self.phase is Phase.CLOSED:
            self._set(t, State.FAILED, self.error or PeerLost(f"peer {self.peer_label} is gone"))
            return False
        owner = self.tags.owned_elsewhere(self._key, t.tag)
        if t.role == SEND and owner is not None:
            self._set(
                t,
                State.FAILED,
                KVTransportError(
                    f"tag {t.tag!r} was announced by another connection ({owner.peer_label}); "
                    "send it on that connection (Endpoint.announced tells which)"
                ),
            )
            return False
        limit = self.limits.max_transfers_per_connection
        if len(self.transfers) >= limit:
            self._set(
                t,
                State.FAILED,
                KVTransportError(
                    f"connection to {self.peer_label} already has {limit} transfers "
                    "(KVTRANSPORT_MAX_TRANSFERS_PER_CONNECTION)"
                ),
            )
            return False
        self.transfers[t.tag] = t
        t.filed = True
        if t.role == SEND:
            self.tags.claim_sending(self._key, t.tag)
        reason = self.tags.take_early_abort(self._key, t.tag)
        if reason is not None:
            self._set(
                t, State.FAILED, TransferAborted(f"transfer {t.tag!r} aborted by peer {self.peer_label}: {reason}")
            )
            return False
        self._changed(t)  # arm its first timeout
        return True

    def _changed(self, t: Transfer) -> None:
        """``t`` changed state (or was filed): re-arm the state's timeout; on a final state
        release what the transfer held and schedule forgetting it."""
        out = self._out
        if t.state.final and not t.counted:
            t.counted = True
            out.append(Observe(t, self._driver_of(t, "none")))
        if t.state is State.FAILED and t.role == RECV and t.announced is None:
            t.drained.set()  # it failed before its pages were announced: nobody could write them
        if not t.filed:
            out.append(SetTimer(t))
            return
        retain = self.timeouts.retain_finished
        if t.state.final:
            if t.announced is not None and self.guard is not None:
                claim, guard = t.announced, self.guard
                t.announced = None
                if t.state is State.SUCCESS or t.drained.is_set():
                    self._stop_arriving(t)
                if t.state is State.SUCCESS:
                    guard.remove(claim)
                else:
                    if not t.drained.is_set():
                        # Its drivers are still driven until the sender confirms its writes
                        # settled (``on_drained``) or it is forgotten: a write already posted
                        # may need the receiving engine's progress to finish (UCX). A sender
                        # that does not confirm in time is cut off, and its writes fenced.
                        put_newest(self.awaiting_drain, t.tag, t, self.limits.max_early_aborts)
                        out.append(Later(self.timeouts.drain, lambda: self._drain_overdue(t)))
                    # Chunks the sender had on the wire may still arrive: recognised, not written.
                    guard.revoke(claim)
                    out.append(Later(retain, lambda: _forget_revoked(guard, claim)))
            out.append(SetTimer(t, retain, lambda: self.forget(t)))
            return
        timeouts = self.timeouts
        limit = {
            State.BOOTSTRAPPING: timeouts.bootstrap,
            State.WAITING_FOR_INPUT: timeouts.waiting + (timeouts.transfer if t.role == RECV else 0.0),
            State.TRANSFERRING: timeouts.transfer,
        }[t.state]
        state = t.state
        out.append(SetTimer(t, limit, lambda: self.expire(t, state, limit)))

    def _start_arriving(self, t: Transfer) -> None:
        if not t.arriving:
            t.arriving = True
            self._out.append(Arriving(+1))

    def _stop_arriving(self, t: Transfer) -> None:
        """Nothing more of receive transfer ``t`` can arrive (once per transfer)."""
        if t.arriving:
            t.arriving = False
            self._out.append(Arriving(-1))

    def _batch_failed(self, t: Transfer, error: KVTransportError) -> None:
        if self._fail_over(t, error):
            return
        if t.lane is not None and self.phase is Phase.READY and not self.closing:
            # (not when the whole connection is going: that says nothing of this lane)
            self._peer.lane_failed(t.lane, f"a transfer failed: {error}")
        self._abort(t, f"{self._driver_of(t, 'driver')}: {error}", notify=True, error=error)

    def _fail_over(self, t: Transfer, error: KVTransportError) -> bool:
        """Whether sending transfer ``t``, whose batch failed with ``error``, goes again over
        another lane (``runtime.failover``) instead of failing: a driver's failure (not the
        connection's), on a live connection, of a transfer sent in one part."""
        if t.role != SEND or t.lane is None or self.phase is not Phase.READY or self.closing:
            return False
        # A driver's own failure (mapped engine errors: EngineError, DriverError, or a plain
        # TransferError as the SPI allows), not the peer's (PeerLost, an abort, a timeout).
        if not (isinstance(error, DriverError) or type(error) is TransferError) or not can_move(t):
            return False
        target = self._peer.failover_target(t.lane)
        if target is None:
            return False
        self._out.append(FailOver(t, t.lane, target, error))
        return True

    def _progress(self, t: Transfer) -> None:
        if t.last_sent and not t.batches and t.state is State.TRANSFERRING:
            # Also when "done" went out on the express stream of a one-sided session: that one
            # is the fast path, this one the guarantee (the stream may have broken, or never
            # bound at the peer, with the frame in its buffer); the receiver ignores whichever
            # comes second. In ordered mode the stream is the only way, and a break of it ends
            # the session, so one copy is all there is.
            self._out.append(FlushNotices())
            if not (t.done_sent and self.ordered):
                lane = wire_name(self._peer.lanes, t.driver)
                self._send("done", {"tag": t.tag, "bytes": t.bytes, "lane": lane, "notices": []})
            if t.submitted_at:
                t.measured_s = self._now() - t.submitted_at
                if t.lane is not None and t.raw_predicted_s:
                    self._out.append(Calibrate(t.lane, t.raw_predicted_s, t.measured_s, t.runs, t.bytes))
            self._set(t, State.SUCCESS)

    def _abort(
        self,
        t: Transfer,
        reason: str,
        *,
        notify: bool,
        local: bool = False,
        error: KVTransportError | None = None,
        by_peer: bool = False,
    ) -> None:
        if t.state.final:
            return
        tag, sending = t.tag, t.role == SEND
        if sending:
            with t.express_lock:
                t.stopping = True
                finished = t.done_sent and not by_peer
            if finished:
                # Its only batch finished and "done" is on its way to the receiver, which will
                # see Success: so does this side (now, if the session is ending; else with the
                # batch's news). Only the peer's own abort still fails it.
                log.debug("abort of %r comes after its express done: not failed (%s)", tag, reason)
                if self.closing:
                    self._set(t, State.SUCCESS)
                return
        t.batches = set()
        # Always through the driver thread, even with no batch known here: a chunk handed to it
        # just now may not have reached this side's bookkeeping yet (send_chunk queues both at
        # once). The driver thread decides what was submitted; "drained" waits for its word.
        stop = sending and bool(self._peer.lanes)
        if stop:
            self.settling[tag] = self.settling.get(tag, 0) + 1
        if error is None:
            error = TransferAborted(f"transfer {t.tag!r} aborted {'locally' if local else ''}: {reason}")
        self._set(t, State.FAILED, error)
        if notify and self.phase is Phase.READY:
            self._send("abort", {"tag": t.tag, "reason": reason})
        if stop:
            self._out.append(StopWrites(t))
        elif sending:
            self._send_drained(tag)  # nothing of it is in flight

    def _on_expect(self, msg: Message) -> None:
        tag = msg["tag"]
        t = self.transfers.get(tag)
        if not well_formed_state(msg["state"]):
            # Checked before anything keeps it: an entry that is not packed int64 could be any
            # amount of memory that the early-announcement byte limit would not see. What is
            # kept (or checked now) is a small stand-in that fails the transfer for the reason.
            msg = msgspec.structs.replace(msg, state=MALFORMED_STATE)
        if t is None:
            self._keep_early_expect(tag, msg)
            return
        if t.role != SEND or t.dst_pages is not None:
            self._send("abort", {"tag": tag, "reason": "duplicate announcement"})
            return
        peer_regions = self._peer.peer_regions
        assert peer_regions is not None
        try:
            pages, aux, state = read_announcement(msg, peer_regions, self.peer_label)
        except InvalidPages as exc:
            self._abort(t, str(exc), notify=True, error=exc)
            return
        t.dst_pages, t.dst_aux, t.peer_prefix = pages, aux, int(msg["prefix"])
        t.dst_page_list = pages.tolist() if pages.size <= SMALL else None
        t.dst_state = state
        self._set(t, State.WAITING_FOR_INPUT)

    def _keep_early_expect(self, tag: str, msg: Message) -> None:
        """An announcement for a transfer this side has not created yet: kept (bounded in
        count and bytes, per connection and in all) until the sender exists, or refused."""
        outcome = self.tags.announcement(self._key, tag, msg)
        if isinstance(outcome, Refused):
            self._send("abort", {"tag": tag, "reason": outcome.reason})
            # Nothing was ever written for this announcement (a peer's transfer still running
            # ignores it: only a failed one takes the confirmation). Unless an aborted transfer
            # of this side under the same tag may still be writing: its own "drained" follows
            # once those writes stopped, and one now would tell the peer its pages are free.
            if tag not in self.settling:
                self._send_drained(tag)
        elif outcome.dropped is not None:
            log.warning(
                "%s announced more than %d transfers nobody sends; forgetting the oldest (%r)",
                self.peer_label,
                self.limits.max_early_expects,
                outcome.dropped,
            )


def _forget_revoked(guard: InboundGuard, claim: Claim) -> list[Action]:
    guard.forget_revoked(claim)
    return []


#: How many times one transfer may move to another lane (``runtime.failover``; each move takes
#: a lane out of its connection).
MAX_FAILOVERS = 3


def can_move(t: Transfer) -> bool:
    """Whether sending transfer ``t`` may go again over another lane: something of it sent, not
    finished, not being aborted, not moved too often already."""
    return (
        bool(t.sent_parts)
        and not t.done_sent
        and not t.state.final
        and not t.stopping
        and not t.aborted_by_caller
        and t.failovers < MAX_FAILOVERS
    )
