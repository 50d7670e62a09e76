"""One connection to one peer: its transfers, their messages and timeouts, and its lanes.

A :class:`Session` is created by the endpoint when a handshake starts and owns everything that
belongs to that peer: the transfers filed under their tags, the pages announced to it (its
:class:`~kvtransport.spi.inbound.InboundGuard`), its heartbeat timer and the transfers' state
timers, the order its messages leave in (the express stream's ordered mode). What the peer said
of tags before their transfers existed is kept in the endpoint's
:class:`~kvtransport.runtime.tags.TagBook`; the caller's handle is
:class:`~kvtransport.runtime.handles.Connection`. The session knows its endpoint only as a
:class:`SessionHost`. When the session ends (peer gone, bye, handshake failure, close) it fails
what is left, disconnects the driver and the endpoint forgets it with everything it held.

Threads: :class:`Connection` methods and ``send_chunk``/``abort_from_caller`` run on the
caller's thread, validate there, and queue the rest; everything else runs on the endpoint's I/O
thread, except the ``_driver_*`` methods, which run on the driver's runner thread.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.checks import (
    MALFORMED_STATE,
    check_aux,
    check_tag,
    read_announcement,
    state_items,
    well_formed_state,
)
from kvtransport.runtime.express_link import ORDERED_KINDS
from kvtransport.runtime.handles import RECV, SEND, Connection, State, Transfer
from kvtransport.runtime.lane import Lane
from kvtransport.runtime.planning import PairPlan
from kvtransport.runtime.tags import Refused, TagBook
from kvtransport.runtime.wire import MAX_INT, Done, Message, encode
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import (
    ChannelDown,
    DriverError,
    EndpointDown,
    InvalidPages,
    KVTransportError,
    MessageTooLarge,
    PeerLost,
    ProtocolError,
    TransferAborted,
    TransferTimeout,
)
from kvtransport.spi.inbound import Claim, InboundGuard
from kvtransport.spi.memory import KVLayout, RegionSet
from kvtransport.spi.plan import (
    SMALL,
    Runs,
    as_pages,
    check_pages,
    check_unique,
    few_pages,
    plan,
)
from kvtransport.spi.tp_map import PairShape

if TYPE_CHECKING:
    from kvtransport.negotiation.hello import Hello
    from kvtransport.negotiation.negotiate import Decision
    from kvtransport.runtime.admission import InitiatorExchange
    from kvtransport.runtime.auth import Seal
    from kvtransport.runtime.config import Limits, Timeouts
    from kvtransport.runtime.control import ControlChannel, Route
    from kvtransport.runtime.express_link import ExpressLink
    from kvtransport.runtime.metrics import Metrics
    from kvtransport.runtime.timers import Timer

log = logging.getLogger(__name__)

#: Longest a receive transfer's announcement waits for a busy driver's ``expecting`` (see
#: ``Session.expecting``): about what the credit round trip it saves costs a small transfer.
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
#: Most driver notices one "done" carries (``release_ordered`` puts the notices of a one-batch
#: transfer in it: one per chunk, and an inline batch has one chunk); more is a protocol error.
MAX_DONE_NOTICES = 8


class Phase(enum.Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"


class SessionHost(Protocol):
    """What a session needs of the endpoint that drives it: its settings and pool, the control
    channel and its timers, the I/O thread's queue, and the tables shared by its sessions.

    ``runtime.endpoint.Endpoint`` implements it; the session imports nothing of the endpoint,
    so the two can be read, and tested, one at a time."""

    name: str
    regions: RegionSet
    layout: KVLayout
    timeouts: Timeouts
    limits: Limits
    max_message_bytes: int
    max_run_bytes: int | None
    metrics: Metrics
    channel: ControlChannel
    #: Which session owns each tag, and what peers said of tags before their transfers
    #: existed, endpoint-wide (a state machine that does no I/O: ``runtime.tags``).
    tags: TagBook[Session]

    def call(self, fn: Callable[[], None]) -> None:
        """Any thread: run ``fn`` on the I/O thread (raises once the endpoint is down)."""

    def post(self, fn: Callable[[], None]) -> None:
        """Any thread: queue ``fn`` for the I/O thread (never raises)."""

    def check_running(self) -> None:
        """Raise if the endpoint is closed or its I/O thread died."""

    def next_batch_id(self) -> int: ...

    def flush_notices(self) -> None:
        """Send the driver notices queued for any peer (they go before "done" and "drained")."""

    def notices_queued_for(self, peer: str) -> bool: ...

    def receiving(self, session: Session, delta: int) -> None:
        """Count a receive transfer of ``session`` in (+1) or out (-1) of those arriving."""

    def end_session(self, session: Session, error: KVTransportError, *, notify: bool) -> None: ...


#: Unique keys for the runner's settle watches (an object's id can be reused once it is gone).
_SETTLE_IDS = itertools.count()


class Session:
    def __init__(
        self, endpoint: SessionHost, conn_id: str, route: Route, peer_label: str, peer_address: str, initiator: bool
    ) -> None:
        self.endpoint = endpoint
        self.id = conn_id
        self.route = route
        self.peer_label = peer_label
        self.peer_address = peer_address
        self.initiator = initiator
        self.handle = Connection(self)
        self.phase = Phase.HANDSHAKE
        self.ready = threading.Event()
        self.error: KVTransportError | None = None
        self.decision: Decision | None = None
        self.peer_regions: RegionSet | None = None
        #: This side's KV paired with the peer's, for planning (made at its first use, after
        #: the handshake set the peer's regions and hello).
        self._plan: PairPlan | None = None
        self.peer_hello: Hello | None = None
        #: One per driver of the decision's lanes, the chosen driver's first (set at handshake).
        self.lanes: dict[str, Lane] = {}
        self.last_seen = time.monotonic()
        self.transfers: dict[str, Transfer] = {}
        #: Sender: failed tags whose aborted batches may still be writing (``drained`` follows).
        self.settling: set[str] = set()
        #: Receiver: failed transfers whose pages were announced and whose sender has not yet
        #: confirmed its writes stopped; kept past ``retain_finished`` (bounded like early aborts).
        self.awaiting_drain: collections.OrderedDict[str, Transfer] = collections.OrderedDict()
        self.guard: InboundGuard | None = None
        self.heartbeat: Timer | None = None
        self.handshake_timer: Timer | None = None
        self.strikes = 0
        #: Initiator between welcome and ready: messages the (already ready) acceptor sent.
        self.held: list[Message] | None = None
        #: A driver notice of this session failed on the driver's thread (its end is queued).
        self.notice_failed = False
        #: This session's message authentication, once the secret was proved both ways.
        self.seal: Seal | None = None
        #: Its express stream (express.py) once bound, and that stream's seal.
        self.express: ExpressLink | None = None
        self.express_seal: Seal | None = None
        #: Ordered mode (a two-sided session whose stream bound before it sent any ordered
        #: message): every message of ``ORDERED_KINDS`` then goes on this link, from whichever
        #: thread sends it, and never on the control channel, so the peer reads them in the
        #: order they were sent. Set once, on the I/O thread, under ``order_lock``; never unset.
        self.ordered: ExpressLink | None = None
        self.order_lock = threading.Lock()
        #: Per thread: ordered messages held back to go out in one write (``hold_ordered``).
        self._held = threading.local()
        #: Whether an ordered message already went out on the control channel (the session can
        #: then no longer switch: one of those could be overtaken by the stream).
        self.sent_ordered_on_control = False
        #: Initiator: its side of the authentication exchange (``runtime.admission``).
        self.exchange: InitiatorExchange | None = None
        #: Set when the session starts closing: no per-transfer confirmations go out then.
        self.closing = False

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def timeouts(self) -> Timeouts:
        return self.endpoint.timeouts

    @property
    def primary(self) -> Lane | None:
        """The lane of the decision's chosen driver."""
        return next(iter(self.lanes.values()), None)

    def lane_named(self, name: str) -> Lane | None:
        """The lane a peer's message names ("": the chosen driver's), or ``None``."""
        return self.lanes.get(name) if name else self.primary

    def wire_name(self, driver: str) -> str:
        """How this side's messages name the lane of ``driver``: "" for the chosen driver
        (whatever the length of its name), else its name."""
        primary = self.primary
        return "" if primary is None or primary.name == driver else driver

    def pick_lane(self, runs: int, nbytes: int) -> Lane:
        """Any thread: the lane with the lowest predicted time for ``runs`` descriptors of
        ``nbytes`` (the chosen driver when only it is a lane, or on a tie)."""
        lanes = list(self.lanes.values())
        if len(lanes) == 1:
            return lanes[0]
        return min(lanes, key=lambda lane: lane.predict(runs, nbytes))

    def __repr__(self) -> str:
        return f"<Session {self.id[:8]} {self.phase.value} {self.peer_label}>"

    # -- caller threads ------------------------------------------------------------------------

    def expect(
        self, tag: str, dst_pages: Any, aux: int | None, prefix: int = 0, state: Sequence[Any] | None = None
    ) -> Transfer:
        ep = self.endpoint
        what = f"transfer {tag!r} destination"
        check_tag(tag)
        if isinstance(prefix, bool) or not isinstance(prefix, int | np.integer) or not 0 <= prefix <= MAX_INT:
            raise KVTransportError(f"{what}: prefix {prefix!r} must be a whole number in [0, 2**62)")
        pages = as_pages(dst_pages, what)
        check_pages(pages, ep.regions.num_pages, what)
        check_unique(pages, what)
        if aux is not None:
            check_aux(aux, ep.regions, f"{what} aux")
        items = tuple(a.copy() for a in state_items(state, ep.regions, what))
        pages = pages.copy()  # the caller may reuse its array; the guard counts these later
        shape = self.shape(sending=False)
        if not shape.source:
            raise KVTransportError(
                f"{what}: {self.peer_label} is not one of this rank's sources (tensor parallelism: "
                "kvtransport.spi.tp_map.sources); announce to the ranks that are"
            )
        if not shape.primary and (aux is not None or items):
            raise InvalidPages(f"{what}: the aux slot and state items go to this rank's first source only")
        transfer = Transfer(self, tag, RECV, State.WAITING_FOR_INPUT)
        claim = Claim(pages, -1 if aux is None else int(aux), items)

        def send_expect() -> None:
            if transfer.state.final:
                return  # failed or aborted before its drivers were ready: the peer heard of that
            self.send(
                "expect",
                tag=tag,
                pages=pages.tobytes(),
                aux=claim.aux,
                prefix=int(prefix),
                state=[g.tobytes() for g in items],
            )

        def announce() -> None:
            if not self.file(transfer):
                return
            transfer.announced = claim
            if self.guard is None:
                self.guard = InboundGuard(ep.regions)
            self.guard.add(claim)
            # The drivers hear first: starting to receive may queue work on a driver's thread
            # (progress), which would keep ``expecting`` off this thread. That work is still
            # queued before the announcement goes out, so a receiver that must drive its
            # engine is driving it by the time the sender's bytes come.
            self.expecting(transfer, send_expect, lambda: self.start_arriving(transfer))

        ep.call(announce)
        return transfer

    def expecting(self, transfer: Transfer, then: Callable[[], None], heard: Callable[[], None]) -> None:
        """I/O thread: tell each two-sided driver that ``transfer`` is coming, then ``heard()``
        (on this thread, once the idle drivers heard), then ``then()`` (the announcement). The
        staged drivers lend ring slots ahead; what a driver sends then
        should reach the peer before the announcement, or the sender, answered at once, finds
        no credit and pays a round trip for one. So a driver whose thread is busy hears of it
        there, and the announcement waits for it, but at most ``EXPECTING_WAIT_S``: that
        thread may be busy for long (another peer's ``connect``), and a lend that comes later
        only costs the round trip it was meant to save."""
        nbytes = self.expected_bytes(transfer)

        def warn_if_failed(lane: Lane, error: KVTransportError | None) -> None:
            if error is not None:
                log.warning("%s: expecting() failed (a hint; the transfer goes on): %s", lane.name, error)

        busy: list[Lane] = []
        for lane in self.lanes.values():
            if not lane.two_sided or type(lane.driver).expecting is KVTransport.expecting:
                continue  # nothing to hear (the SPI's default does nothing): no need to wait
            ran, _, error = lane.runner.try_here(functools.partial(lane.driver.expecting, self.id, nbytes))
            if ran:
                warn_if_failed(lane, error)
            else:
                busy.append(lane)
        heard()
        if not busy:
            then()
            return
        timers = self.endpoint.channel.timers
        sent = [False]

        def announce_once(_: KVTransportError | None = None) -> None:
            if not sent[0]:  # the timer or the last driver, whichever comes first
                sent[0] = True
                timers.cancel(timer)
                then()

        timer = timers.call_later(EXPECTING_WAIT_S, announce_once)
        countdown = _Countdown(len(busy), announce_once)

        def one_heard(lane: Lane, _: Any, error: KVTransportError | None) -> None:
            warn_if_failed(lane, error)
            countdown.one(None)

        for lane in busy:
            try:
                lane.runner.call(
                    functools.partial(lane.driver.expecting, self.id, nbytes), functools.partial(one_heard, lane)
                )
            except KVTransportError:
                countdown.one(None)  # the driver is closed; nothing to get ready

    def sender(self, tag: str) -> Transfer:
        check_tag(tag)
        transfer = Transfer(self, tag, SEND, State.BOOTSTRAPPING)

        def register() -> None:
            if not self.file(transfer):
                return
            early = self.endpoint.tags.take_announcement(self, tag)
            if early is not None:
                self.on_expect(early)

        self.endpoint.call(register)
        return transfer

    def send_chunk(
        self, transfer: Transfer, src_pages: Any, last: bool, aux: int | None, state: Sequence[Any] | None = None
    ) -> None:
        if transfer.state.final:
            raise transfer.error or KVTransportError(f"transfer {transfer.tag!r} already finished")
        if transfer.dst_pages is None:
            raise KVTransportError(
                f"transfer {transfer.tag!r} is {transfer.state.name}: the receiver has not announced "
                "its pages yet; poll until WAITING_FOR_INPUT"
            )
        if transfer.last_planned:
            raise KVTransportError(f"transfer {transfer.tag!r}: the last chunk was already sent")
        assert self.peer_regions is not None
        ep = self.endpoint
        few = few_pages(src_pages)
        src = few if few is not None else as_pages(src_pages, f"transfer {transfer.tag!r} source")
        start, stop = transfer.sent_pages, transfer.sent_pages + len(src)
        announced = transfer.dst_pages.size
        if stop > announced or (last and stop != announced):
            raise InvalidPages(
                f"transfer {transfer.tag!r}: the receiver announced {announced} pages; this chunk "
                f"would make {stop}{' (the last chunk must complete them)' if last else ''}"
            )
        shape = self.shape(sending=True)
        listed = transfer.dst_page_list
        runs = self.plan.kv_runs(
            src, listed[start:stop] if few is not None and listed is not None else transfer.dst_pages[start:stop]
        )
        if not shape.primary:
            # Another rank of this side sends the receiver's aux slot and state (unequal TP).
            aux, state = None, None
        elif last and aux is None and transfer.dst_aux >= 0:
            raise InvalidPages(
                f"transfer {transfer.tag!r}: the receiver announced aux slot {transfer.dst_aux}; the last chunk "
                "must carry one"
            )
        if last and aux is not None:
            if transfer.dst_aux < 0:
                raise InvalidPages(f"transfer {transfer.tag!r}: aux sent but the receiver announced no aux slot")
            check_aux(aux, ep.regions, f"transfer {transfer.tag!r} source aux")
            runs = Runs.concat([runs, plan(ep.regions.aux, self.peer_regions.aux, [aux], [transfer.dst_aux])])
        if state is not None and not last:
            raise InvalidPages(f"transfer {transfer.tag!r}: state items go with the last chunk")
        if last and shape.primary and (state or transfer.dst_state):
            runs = Runs.concat([runs, self.plan.state_runs(transfer.tag, state or (), transfer.dst_state)])
        transfer.sent_pages = stop
        transfer.last_planned = last
        bid = ep.next_batch_id() if len(runs) else 0
        lane = transfer.lane
        if lane is None:
            # The first chunk picks the transfer's driver; later chunks follow it.
            lane = self.pick_lane(len(runs), runs.total_bytes)
            raw = lane.raw_prediction(len(runs), runs.total_bytes)
            transfer.driver = lane.name
            transfer.predicted_s = raw * lane.correction
            transfer.raw_predicted_s = raw if last else 0.0
            transfer.submitted_at = time.monotonic()
            transfer.lane = lane
            if len(self.lanes) > 1:
                log.debug(
                    "transfer %r to %s via %s: %d descriptors, %d bytes, predicted %.3g ms",
                    transfer.tag,
                    self.peer_label,
                    lane.name,
                    len(runs),
                    runs.total_bytes,
                    transfer.predicted_s * 1e3,
                )

        def noted() -> None:
            self.submitted(transfer, bid, runs.total_bytes, last)

        # A transfer of one batch: the thread that sees it finish may send "done" itself.
        express = bool(bid) and last and start == 0 and self.express_done_possible()

        ep.check_running()
        refused: list[ChannelDown] = []

        def submit() -> None:
            try:
                if bid:
                    self._driver_submit(lane, transfer, bid, runs, noted, express)
                else:
                    # Through the lane's queue all the same: a chunk without runs (the last one
                    # of a secondary rank, say) must not overtake a chunk queued before it,
                    # whose batch would then be left out of "done".
                    ep.post(noted)
            except ChannelDown as exc:
                refused.append(exc)
                raise

        def failed(_: Any, error: KVTransportError | None) -> None:
            if error is not None and bid:
                self.batch_failed(transfer, bid, error)

        if runs.total_bytes <= ep.limits.inline_submit_bytes:
            # On this thread when the driver allows it and its thread is idle: a small request
            # then reaches the engine with no thread hop.
            lane.runner.call_here(submit, failed)
        else:
            lane.runner.call(submit, failed)
        if refused:
            # Run here, and the I/O thread would not take the batch (stopped, or backed up for
            # longer than a caller waits): the driver let go of it; the caller hears so now.
            raise EndpointDown(f"endpoint {ep.name}: {refused[0]}") from refused[0]

    @property
    def two_sided(self) -> bool:
        """Whether any lane's driver is two-sided (its notices must precede "done")."""
        return any(map(_TWO_SIDED, self.lanes.values()))

    def express_done_possible(self) -> bool:
        """Whether the thread that sees a one-batch transfer finish may send its "done": on a
        one-sided session with a stream, or a two-sided one in ordered mode (where its chunks'
        notices went out on the same stream before it)."""
        if self.two_sided:
            return self.ordered is not None
        return self.express is not None

    def express_done(self, transfer: Transfer, done: Done) -> None:
        """Any thread, the one that saw a one-batch transfer's batch finish (under the runner's
        claim, so no abort of it runs in the driver meanwhile): "done" straight to the peer on
        the express stream, unless the I/O thread has started failing the transfer. On a
        one-sided session the I/O thread sends it on the control channel as well
        (``progress``), whether or not this one went out; in ordered mode it sends it only
        if this one did not go out."""
        link = self.ordered if self.two_sided else self.express
        if link is None:
            return
        with transfer.express_lock:
            if transfer.stopping or transfer.state.final or self.closing:
                if link is self.ordered:
                    self.release_ordered()  # its notices go all the same, before the news of its end
                return
            if link is self.ordered:
                transfer.done_sent = self.release_ordered(done)
            else:
                transfer.done_sent = link.send(done.encode())

    @property
    def plan(self) -> PairPlan:
        """This side's KV paired with the peer's (``runtime.planning``); any thread, after the
        handshake (two threads that make it at once make equal ones)."""
        pair = self._plan
        if pair is None:
            assert self.peer_regions is not None
            ep, hello = self.endpoint, self.peer_hello
            pair = PairPlan(ep.regions, ep.layout, self.peer_regions, hello.layout if hello else None, ep.max_run_bytes)
            self._plan = pair
        return pair

    def shape(self, *, sending: bool) -> PairShape:
        """What this side moves into the peer's pages (``sending``), or the peer into this
        side's: all of each page, a slice of its heads, or nothing (unequal TP, ``tp_map``)."""
        return self.plan.shape(sending=sending)

    def abort_tag_from_caller(self, tag: str, reason: str) -> None:
        """Caller's thread (``Connection.abort``): fail ``tag`` here, or tell the peer nothing of it is wanted."""
        check_tag(tag)
        self.endpoint.call(lambda: self.abort_tag(tag, reason))

    def close_from_caller(self, reason: str) -> None:
        """Caller's thread (``Connection.close``): "bye" to the peer, then the session ends."""

        def close() -> None:
            if self.phase is Phase.READY:
                self.send("bye", reason=reason)
            self.endpoint.end_session(
                self, TransferAborted(f"connection to {self.peer_label} closed: {reason}"), notify=False
            )

        if self.phase is not Phase.CLOSED:
            self.endpoint.call(close)

    @property
    def layout(self) -> KVLayout:
        """This side's KV layout (its endpoint's)."""
        return self.endpoint.layout

    def abort_from_caller(self, transfer: Transfer, reason: str) -> None:
        self.endpoint.call(lambda: self.abort(transfer, reason, notify=True, local=True))

    # -- I/O thread: transfers -----------------------------------------------------------------

    def send(self, kind: str, **fields: Any) -> bool:
        if self.phase is Phase.CLOSED:
            return False
        return self.send_message(kind, encode(kind, self.endpoint.max_message_bytes, **fields))

    def send_message(self, kind: str, data: bytes) -> bool:
        """I/O thread: one encoded message of type ``kind``, on the express stream in ordered
        mode (``ORDERED_KINDS``), on the control channel otherwise."""
        if kind in ORDERED_KINDS:
            if self.ordered is not None:
                sent = self.send_ordered(data)
                if kind == "bye":
                    self.send_frame(data)
                return sent
            self.sent_ordered_on_control = True
        return self.send_frame(data)

    def send_ordered(self, data: bytes) -> bool:
        """Any thread, ordered mode: ``data`` on the express stream. A message that cannot go
        out whole there cannot go anywhere else either (a later one could overtake it): the
        session ends, with :class:`~kvtransport.spi.errors.PeerLost`, and everything it held
        fails; nothing is left waiting for a message that was never sent."""
        held: list[tuple[str | None, bytes]] | None = getattr(self._held, "items", None)
        if held is not None:
            held.append((None, data))
            return True
        return self._write_ordered((data,))

    def _write_ordered(self, frames: Sequence[bytes]) -> bool:
        link = self.ordered
        assert link is not None
        # Never waits for room: what does not fit waits in the stream's backlog (express.py).
        if link.send_many(frames, queue=True):
            return True
        if not self.closing:
            self.endpoint.post(functools.partial(self.express_lost, link, "a message could not be written to it"))
        return False

    def hold_ordered(self) -> None:
        """Ordered mode: this thread's ordered messages and driver notices of this session
        wait for :meth:`release_ordered`. Held only by the thread that submits a one-batch
        transfer and may see it finish (``_driver_submit``): the chunk notices the driver
        sends from inside ``submit`` then ride in that transfer's "done" (one message, one
        write, read by the peer in one wake-up) instead of going out one frame each. Nothing
        can need to overtake them meanwhile: the transfer's "done" and "drained" come from
        this thread (or after the runner's claim that this thread holds), and every other
        message of the session is about other transfers or ring slots, whose order against
        these does not matter."""
        if getattr(self._held, "items", None) is None:
            self._held.items = []

    def hold_notice(self, lane: str, payload: bytes) -> bool:
        """A driver notice for ``lane``: held, if this thread holds (see :meth:`hold_ordered`)."""
        held: list[tuple[str | None, bytes]] | None = getattr(self._held, "items", None)
        if held is None:
            return False
        held.append((lane, payload))
        return True

    def release_ordered(self, done: Done | None = None) -> bool:
        """Stop holding; send what this thread held, and ``done`` behind it, in one write. The
        held notices ride in that "done" when they are all its lane's and fit in one message.
        Whether it all went out (what a lone :meth:`send_ordered` answers)."""
        items: list[tuple[str | None, bytes]] = getattr(self._held, "items", None) or []
        self._held.items = None
        frames: list[bytes] = []
        if done is not None and 0 < len(items) <= MAX_DONE_NOTICES and set(map(_FIRST, items)) == {done.lane}:
            try:
                frames = [done.encode(list(map(_SECOND, items)))]
            except MessageTooLarge:
                pass  # one frame each, then
        if not frames:
            limit = self.endpoint.max_message_bytes
            frames = [
                data if lane is None else encode("notice", limit, payload=data, lane=lane) for lane, data in items
            ]
            if done is not None:
                frames.append(done.encode())
        return self._write_ordered(frames) if frames else True

    def take_ordered_mode(self, link: ExpressLink) -> bool:
        """I/O thread, when ``link`` bound: a two-sided session that has sent no ordered message
        on the control channel yet (nor queued a driver notice for it) sends all of them on
        ``link`` from now on. Decided once: a session that already used the control channel
        for them stays on it (its stream then carries "done" of nothing)."""
        with self.order_lock:
            if (
                self.ordered is None
                and self.two_sided
                and not self.sent_ordered_on_control
                and not self.endpoint.notices_queued_for(self.id)
            ):
                self.ordered = link
        return self.ordered is link

    def express_lost(self, link: ExpressLink, why: str) -> None:
        """I/O thread: ``link`` broke or closed. In ordered mode that ends the session:
        messages may have been lost with it, and none may take another way."""
        if self.ordered is link and self.phase is not Phase.CLOSED:
            self.endpoint.end_session(
                self,
                PeerLost(f"peer {self.peer_label}: the express stream that carries its transfers' messages {why}"),
                notify=True,
            )

    def send_frame(self, data: bytes) -> bool:
        """One encoded message, sealed once the session is authenticated (only the
        authentication exchange itself goes out unsealed)."""
        if self.seal is not None:
            data = self.seal.seal(data)
        return self.endpoint.channel.send(self.route, data)

    def file(self, transfer: Transfer) -> bool:
        """File ``transfer`` under its tag; fail it at once if it cannot proceed."""
        if transfer.tag in self.transfers:
            transfer._set(State.FAILED, KVTransportError(f"tag {transfer.tag!r} is already in use on this connection"))
            return False
        if self.phase is Phase.CLOSED:
            transfer._set(State.FAILED, self.error or PeerLost(f"peer {self.peer_label} is gone"))
            return False
        tags = self.endpoint.tags
        owner = tags.owned_elsewhere(self, transfer.tag)
        if transfer.role == SEND and owner is not None:
            transfer._set(
                State.FAILED,
                KVTransportError(
                    f"tag {transfer.tag!r} was announced by another connection ({owner.peer_label}); "
                    "send it on that connection (Endpoint.announced tells which)"
                ),
            )
            return False
        limit = self.endpoint.limits.max_transfers_per_connection
        if len(self.transfers) >= limit:
            transfer._set(
                State.FAILED,
                KVTransportError(
                    f"connection to {self.peer_label} already has {limit} transfers "
                    "(KVTRANSPORT_MAX_TRANSFERS_PER_CONNECTION)"
                ),
            )
            return False
        self.transfers[transfer.tag] = transfer
        transfer.filed = True
        if transfer.role == SEND:
            tags.claim_sending(self, transfer.tag)
        reason = tags.take_early_abort(self, transfer.tag)
        if reason is not None:
            transfer._set(
                State.FAILED,
                TransferAborted(f"transfer {transfer.tag!r} aborted by peer {self.peer_label}: {reason}"),
            )
            return False
        self.state_changed(transfer)  # arm its first timeout
        return True

    def state_changed(self, t: Transfer) -> None:
        """Called by :meth:`Transfer._set` (and on filing): re-arm the state's timeout; on a
        final state release what the transfer held and schedule forgetting it."""
        ep = self.endpoint
        timers = ep.channel.timers
        timers.cancel(t.timer)
        t.timer = None
        if t.state.final and not t.counted:
            t.counted = True
            try:
                ep.metrics.observe(t, t.driver or (self.decision.driver if self.decision else "none"), self.peer_label)
            except Exception:
                log.exception("counting transfer %r in the metrics failed", t.tag)
        if t.state is State.FAILED and t.role == RECV and t.announced is None:
            t.drained.set()  # it failed before its pages were announced: nobody could write them
        if not t.filed:
            return
        if t.state.final:
            if t.announced is not None and self.guard is not None:
                claim, guard = t.announced, self.guard
                t.announced = None
                if t.state is State.SUCCESS or t.drained.is_set():
                    self.stop_arriving(t)
                if t.state is State.SUCCESS:
                    guard.remove(claim)
                else:
                    if not t.drained.is_set():
                        # Its drivers are still driven until the sender confirms its writes
                        # settled (``on_drained``) or it is forgotten: a write already posted
                        # may need the receiving engine's progress to finish (UCX).
                        put_newest(self.awaiting_drain, t.tag, t, ep.limits.max_early_aborts)
                    # Chunks the sender had on the wire may still arrive: recognised, not written.
                    guard.revoke(claim)
                    timers.call_later(self.timeouts.retain_finished, lambda: guard.forget_revoked(claim))
            t.timer = timers.call_later(self.timeouts.retain_finished, lambda: self.forget(t))
            return
        limit = {
            State.BOOTSTRAPPING: self.timeouts.bootstrap,
            State.WAITING_FOR_INPUT: self.timeouts.waiting + (self.timeouts.transfer if t.role == RECV else 0.0),
            State.TRANSFERRING: self.timeouts.transfer,
        }[t.state]
        state = t.state

        def expire() -> None:
            if t.state is state:
                self.abort(
                    t,
                    f"timed out in {state.name} after {limit:g} s",
                    notify=True,
                    error=TransferTimeout(f"transfer {t.tag!r} spent more than {limit:g} s in {state.name}"),
                )

        t.timer = timers.call_later(limit, expire)

    def start_arriving(self, t: Transfer) -> None:
        """I/O thread: receive transfer ``t`` was announced; its bytes may arrive from now on."""
        if not t.arriving:
            t.arriving = True
            self.endpoint.receiving(self, +1)

    def stop_arriving(self, t: Transfer) -> None:
        """I/O thread: nothing more of receive transfer ``t`` can arrive (once per transfer)."""
        if t.arriving:
            t.arriving = False
            self.endpoint.receiving(self, -1)

    def forget(self, t: Transfer) -> None:
        self.stop_arriving(t)
        if self.transfers.get(t.tag) is t:
            del self.transfers[t.tag]
            self.endpoint.tags.forget_transfer(self, t.tag)
        t.filed = False

    def submitted(self, transfer: Transfer, bid: int, nbytes: int, last: bool) -> None:
        """A chunk was handed to the driver's thread (batch ``bid``; 0 for a chunk without runs)."""
        if transfer.state.final:
            return
        transfer._set(State.TRANSFERRING)
        transfer.last_sent = last
        if bid:
            transfer.batches.add(bid)
            transfer.bytes += nbytes
        self.progress(transfer)

    def batch_finished(self, transfer: Transfer, bid: int, error: KVTransportError | None) -> None:
        if bid not in transfer.batches:
            return  # aborted meanwhile
        transfer.batches.discard(bid)
        if error is not None:
            self.batch_failed(transfer, bid, error)
            return
        self.progress(transfer)

    def batch_failed(self, transfer: Transfer, bid: int, error: KVTransportError) -> None:
        transfer.batches.discard(bid)
        driver = transfer.driver or (self.decision.driver if self.decision else "driver")
        self.abort(transfer, f"{driver}: {error}", notify=True, error=error)

    def progress(self, transfer: Transfer) -> None:
        if transfer.last_sent and not transfer.batches and transfer.state is State.TRANSFERRING:
            # Also when "done" went out on the express stream of a one-sided session: that one
            # is the fast path, this one the guarantee (the stream may have broken, or never
            # bound at the peer, with the frame in its buffer); the receiver ignores whichever
            # comes second. In ordered mode the stream is the only way, and a break of it ends
            # the session, so one copy is all there is.
            self.endpoint.flush_notices()
            if not (transfer.done_sent and self.ordered is not None):
                self.send(
                    "done", tag=transfer.tag, bytes=transfer.bytes, lane=self.wire_name(transfer.driver), notices=[]
                )
            if transfer.submitted_at:
                transfer.measured_s = time.monotonic() - transfer.submitted_at
                if transfer.lane is not None and transfer.raw_predicted_s:
                    transfer.lane.observe(transfer.raw_predicted_s, transfer.measured_s, self.peer_label)
            transfer._set(State.SUCCESS)

    def abort(
        self,
        transfer: Transfer,
        reason: str,
        *,
        notify: bool,
        local: bool = False,
        error: KVTransportError | None = None,
        by_peer: bool = False,
    ) -> None:
        if transfer.state.final:
            return
        tag, sending = transfer.tag, transfer.role == SEND
        if sending:
            with transfer.express_lock:
                transfer.stopping = True
                finished = transfer.done_sent and not by_peer
            if finished:
                # Its only batch finished and "done" is on its way to the receiver, which will
                # see Success: so does this side (now, if the session is ending; else with the
                # batch's news). Only the peer's own abort still fails it.
                log.debug("abort of %r comes after its express done: not failed (%s)", tag, reason)
                if self.closing:
                    transfer._set(State.SUCCESS)
                return
        transfer.batches = set()
        settling = False
        if sending and self.lanes:
            # Always through the driver thread, even with no batch known here: a chunk handed
            # to it just now may not have reached this thread's bookkeeping yet (send_chunk
            # queues both at once). The driver thread decides what was submitted. Before the
            # first chunk picked a lane, every lane is asked (the caller may be picking one now).
            lanes = [transfer.lane] if transfer.lane is not None else list(self.lanes.values())
            countdown = _Countdown(len(lanes), lambda error: self.settled(tag, error))
            for lane in lanes:
                try:
                    lane.runner.call(functools.partial(self._driver_abort, lane, transfer, tag, countdown.one))
                    settling = True
                except KVTransportError as exc:  # the driver is closed: its close() drained it
                    countdown.count -= 1
                    log.debug("abort of %r on %s not queued: %s", tag, lane.name, exc)
        if error is None:
            error = TransferAborted(f"transfer {transfer.tag!r} aborted {'locally' if local else ''}: {reason}")
        transfer._set(State.FAILED, error)
        if notify and self.phase is Phase.READY:
            self.send("abort", tag=transfer.tag, reason=reason)
        if settling:
            self.settling.add(tag)
        elif sending:
            self.send_drained(tag)  # nothing of it is in flight

    def abort_tag(self, tag: str, reason: str) -> None:
        t = self.transfers.get(tag)
        if t is not None:
            self.abort(t, reason, notify=True, local=True)
        elif self.phase is Phase.READY:
            self.send("abort", tag=tag, reason=reason)

    def send_drained(self, tag: str) -> None:
        if self.phase is Phase.READY and not self.closing:
            # Notices a two-sided driver queued for this peer go first (as before "done").
            self.endpoint.flush_notices()
            self.send("drained", tag=tag)

    def settled(self, tag: str, error: KVTransportError | None) -> None:
        """I/O thread: the aborted batches of ``tag`` can no longer write (or the driver could
        not say: then the receiver is not told, and falls back on its own timeout)."""
        self.settling.discard(tag)
        if error is not None:
            log.warning("%s: cannot confirm that aborted writes of %r stopped: %s", self.peer_label, tag, error)
            return
        self.send_drained(tag)

    # -- I/O thread: messages ------------------------------------------------------------------

    def on_expect(self, msg: Message) -> None:
        tag = msg["tag"]
        t = self.transfers.get(tag)
        if not well_formed_state(msg["state"]):
            # Checked before anything keeps it: an entry that is not packed int64 could be any
            # amount of memory that the early-announcement byte limit would not see. What is
            # kept (or checked now) is a small stand-in that fails the transfer for the reason.
            msg = Message(msg.type, {**msg.fields, "state": MALFORMED_STATE})
        if t is None:
            self._keep_early_expect(tag, msg)
            return
        if t.role != SEND or t.dst_pages is not None:
            self.send("abort", tag=tag, reason="duplicate announcement")
            return
        assert self.peer_regions is not None
        try:
            pages, aux, state = read_announcement(msg, self.peer_regions, self.peer_label)
        except InvalidPages as exc:
            self.abort(t, str(exc), notify=True, error=exc)
            return
        t.dst_pages, t.dst_aux, t.peer_prefix = pages, aux, int(msg["prefix"])
        t.dst_page_list = pages.tolist() if pages.size <= SMALL else None
        t.dst_state = state
        t._set(State.WAITING_FOR_INPUT)

    def _keep_early_expect(self, tag: str, msg: Message) -> None:
        """An announcement for a transfer this side has not created yet: kept (bounded in
        count and bytes, per connection and in all) until the sender exists, or refused."""
        outcome = self.endpoint.tags.announcement(self, tag, msg)
        if isinstance(outcome, Refused):
            self.send("abort", tag=tag, reason=outcome.reason)
            # Nothing was ever written for this announcement (a peer's transfer still running
            # ignores it: only a failed one takes the confirmation).
            self.send_drained(tag)
        elif outcome.dropped is not None:
            log.warning(
                "%s announced more than %d transfers nobody sends; forgetting the oldest (%r)",
                self.peer_label,
                self.endpoint.limits.max_early_expects,
                outcome.dropped,
            )

    def on_done(self, msg: Message) -> None:
        notices = msg["notices"]
        if notices:
            # The notices that rode in it come first, as if they had come as messages of their
            # own just before it (their chunks occupy ring slots whatever became of the transfer).
            if len(notices) > MAX_DONE_NOTICES or not all(isinstance(n, bytes) for n in notices):
                raise ProtocolError(f"done.notices must be a list of at most {MAX_DONE_NOTICES} byte strings")
            for payload in notices:
                self.take_notice(msg["lane"], payload)
                if self.phase is Phase.CLOSED:
                    return  # a notice ended the session: nothing of it is trusted any more
        t = self.transfers.get(msg["tag"])
        if t is None:
            # A transfer this side already failed and forgot (timeout, abort): a benign race.
            log.debug("done for %r from %s, which is no longer tracked", msg["tag"], self.peer_label)
            return
        if t.role != RECV:
            raise ProtocolError(f"done for transfer {msg['tag']!r}, which this side sends")
        if t.state.final or t.peer_done:
            return
        lane = self.lane_named(msg["lane"])
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
        # are still being copied into our pages. Queued behind the notices that came before
        # this "done" (or run right here when the driver is idle, so has seen all of them), so
        # no check can answer before its driver has seen all of them.
        self.after_inbound(t, "inbound", lambda error: self.inbound_settled(t, error))
        if t.state is State.WAITING_FOR_INPUT and any(x.two_sided for x in self.lanes.values()):
            # Not answered in this pass (a driver is still copying in): Transferring meanwhile.
            # Answered at once (the usual case for a small transfer), it went straight to
            # Success, as a one-sided transfer's does, without a state change in between.
            t._set(State.TRANSFERRING)

    def after_inbound(self, t: Transfer, kind: str, then: Callable[[KVTransportError | None], None]) -> None:
        """``then(first error or None)`` once every two-sided lane's inbound work from this
        peer is idle (at once when there is none). Every lane, not the one the peer names: its
        word on which driver moved a transfer's bytes is not trusted with our pages."""
        sided = [x for x in self.lanes.values() if x.two_sided]
        if not sided:
            then(None)
            return
        countdown = _Countdown(len(sided), then)
        for x in sided:
            # Idle already (the usual case for a small transfer: the driver copied its chunks
            # in on this thread as their notices came): answered in this pass, with no trip
            # through the driver's thread and back through the I/O thread's queue. Not once a
            # notice failed on the driver's thread: that failure is queued for this thread, and
            # the answer must come after it, as it does through the queue.
            if not self.notice_failed:
                ran, idle, error = x.runner.try_here(functools.partial(x.driver.inbound_idle, self.id))
                if ran and (idle or error is not None):
                    countdown.one(error)
                    continue
            try:
                x.runner.call_here(functools.partial(self._driver_watch_idle, kind, x, t, countdown.one))
            except KVTransportError:
                countdown.one(None)  # the driver is closed: none of its copies runs any more

    def expected_bytes(self, t: Transfer) -> int:
        """What a complete transfer writes into the pages (aux slot, state items) ``t`` announced."""
        claim = t.announced
        return 0 if claim is None else self.plan.expected_bytes(claim)

    def inbound_settled(self, t: Transfer, error: KVTransportError | None) -> None:
        if error is not None:
            # The driver found the peer's inbound data unusable (e.g. a chunk notice pointing
            # outside the announced pages): nothing from that peer can be trusted to be in place.
            self.endpoint.end_session(self, error, notify=True)
            return
        if t.peer_done:
            t._set(State.SUCCESS)

    def on_abort(self, msg: Message) -> None:
        tag, reason = msg["tag"], msg["reason"]
        t = self.transfers.get(tag)
        if t is not None:
            if t.role == SEND and t.state is State.SUCCESS:
                self.send_drained(tag)  # every write of it completed
            self.abort(
                t,
                f"aborted by peer {self.peer_label}: {reason}",
                notify=False,
                error=TransferAborted(f"transfer {t.tag!r} aborted by peer {self.peer_label}: {reason}"),
                by_peer=True,
            )
            return
        if not self.endpoint.tags.early_abort(self, tag, str(reason)):
            # Only the session that announced a tag can abort it: this one never did.
            log.debug("ignoring an abort for %r from %s: another connection owns it", tag, self.peer_label)
            return
        if tag not in self.settling:
            self.send_drained(tag)  # this side never wrote (or no longer writes) anything of it

    def on_drained(self, msg: Message) -> None:
        t = self.awaiting_drain.pop(msg["tag"], None) or self.transfers.get(msg["tag"])
        if t is None or t.role != RECV or not t.state.final:
            # Forgotten already (the engine fell back on its own timeout), ours to send, or still
            # running (a sender confirms only after the abort it sent first): nothing to learn.
            log.debug("drained for %r from %s ignored", msg["tag"], self.peer_label)
            return

        # Copies into our pages by a two-sided driver are this side's own work: wait until
        # they are idle too.
        def drained(error: KVTransportError | None) -> None:
            if error is None:
                t.drained.set()
                self.stop_arriving(t)

        self.after_inbound(t, "drained", drained)

    def on_notice(self, msg: Message) -> None:
        self.take_notice(msg["lane"], msg["payload"])

    def take_notice(self, lane_name: str, payload: bytes) -> None:
        """A driver notice from the peer for the two-sided driver ``lane_name`` names (a
        "notice" message, or one that rode in a "done")."""
        lane = self.lane_named(lane_name)
        if lane is None or not lane.two_sided:
            raise ProtocolError(f"notice for {lane_name[:64] or '?'!r}, not a two-sided driver of this connection")
        driver = lane.driver
        # A small notice right here when the driver allows it and is idle: a small chunk's
        # copy-in then costs no thread wake-up, and the "done" behind it finds the driver idle
        # too. A large one (many pieces to check) goes to the runner, off the I/O thread.
        if len(payload) <= INLINE_NOTICE_MAX_BYTES:
            ran, _, error = lane.runner.try_here(functools.partial(driver.on_notice, self.id, payload))
            if ran:
                if error is not None:
                    self.endpoint.end_session(self, error, notify=True)
                return

        def on_runner() -> None:
            try:
                driver.on_notice(self.id, payload)
            except Exception:
                # Seen by ``after_inbound`` before this failure's end_session (posted to the I/O
                # thread's queue) runs: a "done" read meanwhile must not find the driver idle
                # and answer Success ahead of it.
                self.notice_failed = True
                raise

        lane.runner.call(
            on_runner, lambda _, error: self.endpoint.end_session(self, error, notify=True) if error else None
        )

    # -- I/O thread: the end -------------------------------------------------------------------

    def close(self, error: KVTransportError, *, notify: bool) -> None:
        """Fail every transfer, disconnect the driver; the endpoint then forgets the session."""
        if self.phase is Phase.CLOSED:
            return
        self.closing = True  # the peer is gone or told "bye": no per-transfer confirmations
        for t in list(self.transfers.values()):
            self.abort(t, str(error), notify=notify, error=error)
        self.phase = Phase.CLOSED
        self.error = self.error or error
        timers = self.endpoint.channel.timers
        timers.cancel(self.heartbeat)
        timers.cancel(self.handshake_timer)
        filed = list(self.transfers)
        for t in [*self.transfers.values(), *self.awaiting_drain.values()]:
            timers.cancel(t.timer)
            t.filed = False
            self.stop_arriving(t)  # the driver forgets the peer: nothing more of it arrives
        self.transfers.clear()
        self.awaiting_drain.clear()
        self.endpoint.tags.forget(self, filed)  # its early tables, and every tag it owned
        for lane in self.lanes.values():
            if lane.connect_queued:
                driver = lane.driver
                try:
                    lane.runner.call(functools.partial(driver.disconnect, self.id))
                except KVTransportError:
                    pass
        self.ready.set()

    # -- driver thread -------------------------------------------------------------------------

    def _driver_submit(
        self, lane: Lane, transfer: Transfer, bid: int, runs: Runs, noted: Callable[[], None], express: bool = False
    ) -> None:
        """Driver thread (or the sender's, ``call_here``): hand the batch to the driver and watch
        it. The I/O thread hears of the batch (``noted``) after the engine has it, so that no
        wake-up of the I/O thread competes with posting it, and before its result, in the
        same wake-up when the engine finished it inside ``submit``."""
        if transfer.state.final or transfer.driver_stopped:
            self.endpoint.post(noted)
            return  # failed or aborted before its batch got here: nothing may be written now
        if express and self.two_sided:  # express on a two-sided session: in ordered mode
            # The notices of a batch that finishes inside ``submit`` go out with its "done".
            self.hold_ordered()
            try:
                self._submit_and_watch(lane, transfer, bid, runs, noted, express)
            finally:
                self.release_ordered()
        else:
            self._submit_and_watch(lane, transfer, bid, runs, noted, express)

    def _submit_and_watch(
        self, lane: Lane, transfer: Transfer, bid: int, runs: Runs, noted: Callable[[], None], express: bool
    ) -> None:
        driver, runner = lane.driver, lane.runner
        # "done" packed ahead, all but the notices that may ride in it: before ``submit`` when
        # the driver is two-sided (a small chunk is written, and finishes, inside it), after it
        # otherwise (while the engine writes).
        ahead = express and lane.two_sided
        limit = self.endpoint.max_message_bytes
        done_message = Done(transfer.tag, runs.total_bytes, self.wire_name(transfer.driver), limit) if ahead else None
        try:
            handle = driver.submit(self.id, runs)
        except BaseException:
            self.release_ordered()  # a notice held from inside it goes before the failure's news
            self.endpoint.post(noted)  # before the failure, which the runner posts next
            raise
        lane.handles[bid] = (handle, transfer)
        if express and done_message is None:
            done_message = Done(transfer.tag, runs.total_bytes, self.wire_name(transfer.driver), limit)

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
        wait = self.endpoint.limits.inline_wait_us * 1e-6 if small and not signalled else 0.0
        try:
            runner.watch(
                ("batch", handle),
                check,
                lambda _, error: self.batch_finished(transfer, bid, error),
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

    def _driver_abort(
        self, lane: Lane, transfer: Transfer, tag: str, then: Callable[[KVTransportError | None], None]
    ) -> None:
        """Driver thread: stop every batch of ``transfer`` on ``lane`` (no later one is
        submitted), then watch until the driver says none of them can write any more, and tell
        the I/O thread (``then``). Gives up, without confirming, after the transfer timeout."""
        driver, runner = lane.driver, lane.runner
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
        give_up = time.monotonic() + self.timeouts.transfer

        def quiet() -> bool:
            aborted[:] = [h for h in aborted if not driver.settled(h)]
            if aborted and time.monotonic() > give_up:
                raise DriverError(
                    f"{runner.name}: {len(aborted)} aborted batch(es) of {tag!r} still not settled after "
                    f"{self.timeouts.transfer:g} s"
                )
            return not aborted

        runner.watch(("settle", self.id, next(_SETTLE_IDS)), quiet, lambda _, error: then(error))

    def _driver_watch_idle(
        self, kind: str, lane: Lane, t: Transfer, then: Callable[[KVTransportError | None], None]
    ) -> None:
        """Driver thread: ``then`` once ``lane``'s driver has no inbound work from this peer.
        ``kind`` keeps a transfer's two checks apart ("inbound": before its Success, found early
        through the driver's ``inbound_progress`` signal; "drained": after its failure)."""
        driver = lane.driver
        lane.runner.watch((kind, self.id, id(t)), lambda: driver.inbound_idle(self.id), lambda _, error: then(error))


_TWO_SIDED = operator.attrgetter("two_sided")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


class _Countdown:
    """I/O thread: calls ``then`` with the first error (or ``None``) once ``count`` parts
    answered (the lanes an abort or a drain check went to)."""

    def __init__(self, count: int, then: Callable[[KVTransportError | None], None]) -> None:
        self.count = count
        self.then = then
        self.error: KVTransportError | None = None

    def one(self, error: KVTransportError | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.count -= 1
        if self.count == 0:
            self.then(self.error)
