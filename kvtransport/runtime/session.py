"""One connection to one peer: the session that carries out its protocol machine's actions.

A :class:`Session` is created by the endpoint when a handshake starts and holds what belongs to
that peer: its route, keys and lanes (one per driver the handshake chose), its heartbeat and
handshake timers, its express stream and ordered mode (``runtime.ordered``), and the caller's
handle (:class:`~kvtransport.runtime.handles.Connection`). What the protocol decides (the
transfers under their tags, what each message means for them, their states and timeouts,
aborts) is its :class:`~kvtransport.runtime.peer_protocol.PeerProtocol`, a machine that does no
I/O: the session feeds it events (the peer's messages, the caller's requests, the drivers'
outcomes, the timers) and carries out the actions it answers with: messages sent, timers
armed, driver calls made (``runtime.driver_side``). The session knows its endpoint only as a
:class:`SessionHost`. When the session ends (peer gone, bye, handshake failure, close) its
machine fails what is left, the drivers forget the peer and the endpoint forgets the session.

Threads: :class:`Connection` methods, ``expect``, ``sender``, ``send_chunk`` and
``abort_from_caller`` run on the caller's thread, validate there, and queue the rest; the
machine and everything it asks for run on the endpoint's I/O thread; driver calls run on the
driver's runner thread (``runtime.driver_side``).
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

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
from kvtransport.runtime.checks import check_aux, check_tag, state_items
from kvtransport.runtime.chunk import Chunk
from kvtransport.runtime.driver_side import SessionDrivers
from kvtransport.runtime.express_link import ORDERED_KINDS
from kvtransport.runtime.failover import Failover
from kvtransport.runtime.handles import RECV, SEND, Connection, State, Transfer
from kvtransport.runtime.lane import MIN_SAMPLES, REFERENCE_BYTES, REFERENCE_RUNS, Lane, LanePicker
from kvtransport.runtime.layer_groups import Grouper, LayerwisePolicy, regions_by_layer
from kvtransport.runtime.layer_groups import region_layers as region_layers_of
from kvtransport.runtime.layerwise import LayerStream
from kvtransport.runtime.ordered import OrderedStream
from kvtransport.runtime.pacing import Pacer, slice_size
from kvtransport.runtime.peer_protocol import (
    PeerProtocol,
    Phase,
    done_notices,
    lane_named,
    primary_lane,
    wire_name,
)
from kvtransport.runtime.planning import PairPlan
from kvtransport.runtime.tags import TagBook
from kvtransport.runtime.wire import MAX_INT, Message, encode
from kvtransport.spi.errors import (
    ChannelDown,
    EndpointDown,
    InvalidPages,
    KVTransportError,
    PeerLost,
    TransferAborted,
)
from kvtransport.spi.inbound import Claim, InboundGuard
from kvtransport.spi.memory import KVLayout, RegionSet
from kvtransport.spi.plan import Runs, as_pages, check_pages, check_unique
from kvtransport.spi.tp_map import PairShape

if TYPE_CHECKING:
    import collections

    from kvtransport.negotiation.hello import Hello
    from kvtransport.negotiation.negotiate import Decision
    from kvtransport.runtime.admission import InitiatorExchange
    from kvtransport.runtime.auth import Seal
    from kvtransport.runtime.config import Limits, Timeouts
    from kvtransport.runtime.control import ControlChannel, Route
    from kvtransport.runtime.express_link import ExpressLink
    from kvtransport.runtime.metrics import Metrics
    from kvtransport.runtime.readiness import ReadinessWatcher
    from kvtransport.runtime.runner import DriverRunner
    from kvtransport.runtime.timers import Timer, TimerHeap
    from kvtransport.spi.driver import KVTransport

__all__ = ["Phase", "Session", "SessionHost"]

log = logging.getLogger(__name__)

#: A caller thread's claim on a lane on probation while it picks it (then its transfer's).
_PICKING = object()


def _part_done(transfer: object, token: int) -> None:
    """A paced part of ``transfer`` has no slice waiting or in the driver any more."""
    assert isinstance(transfer, Transfer)
    transfer.paced.discard(token)


#: A driver that cannot fence a departed peer yet is asked again after this long, doubling up
#: to the second figure, and given up on (pages stay held) after the third.
FENCE_RETRY_FIRST_S = 0.5
FENCE_RETRY_MAX_S = 30.0
FENCE_GIVE_UP_S = 3600.0


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

    def readiness(self) -> ReadinessWatcher:
        """The endpoint's watcher of senders' readiness signals (started on first use)."""

    def check_lane_identity(self, session: Session, driver: str, info: bytes) -> None:
        """Raise unless ``info``, which the peer of ``session`` presents for ``driver``'s lane
        coming back from quarantine, is the peer's own (``SessionSetup.check_identity``)."""

    @property
    def drivers(self) -> Mapping[str, KVTransport]:
        """The endpoint's open drivers, by name."""

    @property
    def runners(self) -> Mapping[str, DriverRunner]:
        """Each open driver's thread, by name."""


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
        self.ready = threading.Event()
        self.decision: Decision | None = None
        self.peer_regions: RegionSet | None = None
        #: This side's KV paired with the peer's, for planning (made at its first use, after
        #: the handshake set the peer's regions and hello).
        self._plan: PairPlan | None = None
        #: The KV regions of each layer, for layer-wise sends (made at the first one).
        self._regions_of: tuple[tuple[int, ...], ...] | None = None
        self.peer_hello: Hello | None = None
        #: One per driver of the decision's lanes, the chosen driver's first (set at handshake).
        self.lanes: dict[str, Lane] = {}
        self.picker: LanePicker | None = None  # set with the lanes
        #: The lane a connection that learns its lanes' costs last found fastest (log once per change).
        self.fastest_lane = ""
        self._ranking_logged = -1e9
        #: This side's per-connection receive infos (``KVTransport.receive_info``), by driver,
        #: and the open drivers that made one (each is disconnected when the session ends).
        self.receive_infos: dict[str, bytes] = {}
        self.receivers_asked: set[str] = set()
        self.last_seen = time.monotonic()
        self.heartbeat: Timer | None = None
        self.handshake_timer: Timer | None = None
        self.strikes = 0
        #: Initiator between welcome and ready: messages the (already ready) acceptor sent.
        self.held: list[Message] | None = None
        #: This session's message authentication, once the secret was proved both ways.
        self.seal: Seal | None = None
        #: Its express stream (express.py) once bound, and that stream's seal.
        self.express: ExpressLink | None = None
        self.express_seal: Seal | None = None
        #: Initiator: its side of the authentication exchange (``runtime.admission``).
        self.exchange: InitiatorExchange | None = None
        #: What the protocol decides, as a machine that does no I/O (``runtime.peer_protocol``).
        self.protocol = PeerProtocol(
            self,
            self,
            peer_label,
            regions=endpoint.regions,
            limits=endpoint.limits,
            timeouts=endpoint.timeouts,
            tags=endpoint.tags,
        )
        #: Ordered mode: its ordered messages on the express stream (``runtime.ordered``).
        self.order = OrderedStream(self)
        #: Its calls into its lanes' drivers (``runtime.driver_side``).
        self.drivers = SessionDrivers(self)
        #: Its transfers moved off failed lanes, and the peer's failed lanes it fences.
        self.failover = Failover(self)
        #: Each lane's pacer, made at its first use (``runtime.pacing``).
        self._pacers: dict[str, Pacer] = {}
        self._pacers_lock = threading.Lock()

    # -- what the machine holds, read by the endpoint and the handles -------------------------

    @property
    def phase(self) -> Phase:
        return self.protocol.phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self.protocol.phase = phase

    @property
    def error(self) -> KVTransportError | None:
        return self.protocol.error

    @property
    def transfers(self) -> dict[str, Transfer]:
        return self.protocol.transfers

    @property
    def awaiting_drain(self) -> collections.OrderedDict[str, Transfer]:
        return self.protocol.awaiting_drain

    @property
    def guard(self) -> InboundGuard | None:
        return self.protocol.guard

    @property
    def closing(self) -> bool:
        return self.protocol.closing

    @property
    def closed(self) -> bool:
        return self.protocol.phase is Phase.CLOSED

    # -- facts ---------------------------------------------------------------------------------

    @property
    def timeouts(self) -> Timeouts:
        return self.endpoint.timeouts

    @property
    def limits(self) -> Limits:
        return self.endpoint.limits

    @property
    def timers(self) -> TimerHeap:
        return self.endpoint.channel.timers

    @property
    def max_message_bytes(self) -> int:
        return self.endpoint.max_message_bytes

    @property
    def layout(self) -> KVLayout:
        """This side's KV layout (its endpoint's)."""
        return self.endpoint.layout

    @property
    def primary(self) -> Lane | None:
        """The lane of the decision's chosen driver."""
        return primary_lane(self.lanes)

    def lane_named(self, name: str) -> Lane | None:
        """The lane a peer's message names ("": the chosen driver's), or ``None``."""
        return lane_named(self.lanes, name)

    def peer_endpoint_info(self, driver: str) -> bytes:
        """The peer's endpoint-wide connection info for ``driver`` (from its hello)."""
        entry = self.peer_hello.drivers.get(driver) if self.peer_hello is not None else None
        return entry.conn if entry is not None else b""

    def check_lane_identity(self, driver: str, info: bytes) -> None:
        """Raise unless ``info``, presented by the peer for ``driver``'s lane coming back from
        quarantine, is the peer's own (not this endpoint's, not another connection's)."""
        self.endpoint.check_lane_identity(self, driver, info)

    def wire_name(self, driver: str) -> str:
        """How this side's messages name the lane of ``driver``."""
        return wire_name(self.lanes, driver)

    @property
    def two_sided(self) -> bool:
        """Whether any lane's driver is two-sided (its notices must precede "done")."""
        return self.protocol.two_sided

    def usable_lanes(self) -> list[Lane]:
        """Any thread: the lanes a transfer may take: all but those that failed (learning or
        standby lanes whose connect or a transfer failed, lanes failed over from) and, while
        another is usable, standby lanes. Never empty: the chosen driver's lane is left when
        nothing else is (a failover happens only towards a usable lane)."""
        usable = [lane for lane in self.lanes.values() if not lane.broken]
        # A lane back from quarantine takes one transfer at a time until one passed (its probe).
        free = [lane for lane in usable if not lane.probing()] or usable
        active = [lane for lane in free if not lane.standby]
        return active or free or list(self.lanes.values())[:1]

    def lane_failed(self, lane: Lane, why: str) -> None:
        """I/O thread: a transfer on ``lane`` failed (not failed over): a lane kept to learn
        from or on standby is not used again (``Lane.failed``), unless it is the last usable
        one (then the connection's fate is its own, as the chosen driver's is)."""
        if any(other is not lane and not other.broken for other in self.lanes.values()):
            lane.failed(why, self.peer_label)

    def failover_target(self, failed: Lane) -> Lane | None:
        """I/O thread: the lane the transfers of ``failed`` go to when it fails, or ``None``:
        the best-ranked usable one other than it (a lane that learns: the one predicted
        fastest for a reference transfer), a standby lane last."""
        others = [lane for lane in self.lanes.values() if lane is not failed and not lane.broken]
        if not others:
            return None
        # (a lane on probation last: its probe has not passed yet)
        return min(
            others, key=lambda lane: (lane.probation, lane.standby, lane.predict(REFERENCE_RUNS, REFERENCE_BYTES))
        )

    def pick_lane(self, runs: int, nbytes: int, *, whole: bool = False) -> Lane:
        """Any thread: the lane with the lowest predicted time for ``runs`` descriptors of
        ``nbytes`` (the chosen driver when only it is a lane, or on a tie). A ``whole``
        transfer (sent in one part: its time is measured) of a connection that learns its
        lanes' costs may go to a lane it has not measured enough yet (:class:`LanePicker`)."""
        while True:
            lane = self._pick(runs, nbytes, whole)
            # One probe at a time on a lane back from quarantine: another caller's may have
            # claimed it since (then pick again: it is left out now).
            if lane.claim_probe(_PICKING) or not any(other is not lane for other in self.usable_lanes()):
                return lane

    def _pick(self, runs: int, nbytes: int, whole: bool) -> Lane:
        lanes = self.usable_lanes()
        if len(lanes) == 1:
            return lanes[0]
        picker = self.picker if whole else None
        if picker is not None:
            explored = picker.explore()
            if explored is not None:
                return explored
        fastest = min(lanes, key=lambda lane: lane.predict(runs, nbytes))
        if picker is not None:
            picker.picked(fastest)
        return fastest

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

    def expected_bytes(self, t: Transfer) -> int:
        """What a complete transfer writes into the pages (aux slot, state items) ``t`` announced."""
        return self.protocol.expected_bytes(t)

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
        fields = {
            "tag": tag,
            "pages": pages.tobytes(),
            "aux": claim.aux,
            "prefix": int(prefix),
            "state": [g.tobytes() for g in items],
        }
        ep.call(lambda: self.run(self.protocol.announce_receiver(transfer, claim, fields)))
        return transfer

    def sender(self, tag: str) -> Transfer:
        check_tag(tag)
        transfer = Transfer(self, tag, SEND, State.BOOTSTRAPPING)
        self.endpoint.call(lambda: self.run(self.protocol.register_sender(transfer)))
        return transfer

    def send_chunk(
        self, transfer: Transfer, src_pages: Any, last: bool, aux: int | None, state: Sequence[Any] | None = None
    ) -> None:
        self.check_sendable(transfer)
        with transfer.plan_lock:
            if transfer.last_planned:
                raise KVTransportError(f"transfer {transfer.tag!r}: the last chunk was already sent")
            runs, stop = self.plan.chunk_runs(transfer, src_pages, last, aux, state)
            transfer.sent_pages = stop
            transfer.last_planned = last
            transfer.parts += 1
            # With a layer-wise send still posting, its last group is the transfer's last part.
            self.submit_part(transfer, runs, last and not transfer.open_streams)

    def send_layerwise(
        self,
        transfer: Transfer,
        src_pages: Any,
        last: bool,
        aux: int | None,
        state: Sequence[Any] | None,
        policy: LayerwisePolicy | None,
        region_layers: Sequence[int] | None,
    ) -> LayerStream:
        """Caller's thread (``Transfer.send_layerwise``): check the chunk and reserve its
        pages; its layer groups are posted by the stream (``runtime.layerwise``)."""
        self.check_sendable(transfer)
        ep = self.endpoint
        policy = policy if policy is not None else LayerwisePolicy.from_env()
        if region_layers is None:
            regions_of = self._regions_of
            if regions_of is None:  # once per connection: the layout does not change
                layers = region_layers_of(ep.layout, ep.regions)
                regions_of = self._regions_of = regions_by_layer(layers, ep.layout.num_layers)
        else:
            regions_of = regions_by_layer(region_layers_of(ep.layout, ep.regions, region_layers), ep.layout.num_layers)
        with transfer.plan_lock:
            if transfer.last_planned:
                raise KVTransportError(f"transfer {transfer.tag!r}: the last chunk was already sent")
            chunk = self.plan.chunk(transfer, src_pages, last, aux, state)
            check_pages(as_pages(chunk.src, f"transfer {transfer.tag!r} source"), ep.regions.num_pages, "source")
            transfer.sent_pages = chunk.stop
            transfer.last_planned = last
            transfer.open_streams += 1
        tokens = (chunk.stop - chunk.start) * max(1, ep.layout.page_size)
        return LayerStream(self, transfer, chunk, last, regions_of, Grouper(ep.layout.num_layers, tokens, policy))

    def send_group(
        self,
        transfer: Transfer,
        chunk: Chunk,
        kv: Sequence[int] | None,
        tail: bool,
        closes: bool,
        *,
        whole: bool = False,
    ) -> int:
        """Any thread (a layer-wise stream's): plan chunk ``chunk``'s pages in KV regions ``kv``
        (with its aux slot and state items when ``tail``) and hand them to the driver;
        ``closes``: the stream's last group; ``whole``: the stream's only group (a request
        below the minimum length), sent as a whole-request send would be. Returns the batch
        id (0: nothing to write)."""
        self.check_sendable(transfer)
        with transfer.plan_lock:
            runs = self.plan.part_runs(chunk, kv, tail=tail)
            transfer.parts += 1
            if closes:
                transfer.open_streams -= 1
            last = closes and transfer.last_planned and not transfer.open_streams
            # Never on the marking thread while layers are still to come: it is the one that
            # computes (or launches) them, and an engine may copy inside submit (UCX's shared
            # memory does). A request in one group goes as a whole-request send does.
            return self.submit_part(transfer, runs, last, inline=whole)

    def readiness(self) -> ReadinessWatcher:
        return self.endpoint.readiness()

    def check_sendable(self, transfer: Transfer) -> None:
        """Any thread: raise why nothing more of ``transfer`` may be sent now."""
        if transfer.state.final:
            raise transfer.error or KVTransportError(f"transfer {transfer.tag!r} already finished")
        if transfer.aborted_by_caller:
            raise TransferAborted(f"transfer {transfer.tag!r} was aborted: {transfer.aborted_by_caller}")
        if transfer.dst_pages is None:
            raise KVTransportError(
                f"transfer {transfer.tag!r} is {transfer.state.name}: the receiver has not announced "
                "its pages yet; poll until WAITING_FOR_INPUT"
            )

    def submit_part(
        self,
        transfer: Transfer,
        runs: Runs,
        last: bool,
        *,
        inline: bool = True,
        express: bool = True,
        again: bool = False,
    ) -> int:
        """Hand one part of ``transfer`` (a chunk, a layer group) to its lane's driver;
        ``last``: nothing of the transfer follows; ``inline``: a small part may be submitted
        on this thread; ``express``: a one-part transfer's "done" may go on the express
        stream (not after a failover: it must follow the "lane_down"); ``again``: a part sent
        before, sent again over another lane (``runtime.failover``). Under the transfer's
        ``plan_lock``."""
        lane = transfer.lane
        if lane is None:
            # The first part picks the transfer's driver; later parts follow it.
            lane = self.pick_lane(len(runs), runs.total_bytes, whole=last)
            if lane.canary is _PICKING:
                lane.canary = transfer  # its probe (``Lane.probation``)
            raw = lane.raw_prediction(len(runs), runs.total_bytes)
            transfer.driver = lane.name
            transfer.predicted_s = raw * lane.correction
            transfer.raw_predicted_s = raw if last else 0.0
            transfer.runs = len(runs)
            transfer.submitted_at = time.monotonic()
            transfer.lane = lane
            transfer.lane_gen = lane.gen
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

        if not again:
            transfer.sent_parts.append((runs, last))  # what a failover would send again
        transfer.last_part_at = time.monotonic()
        # A part no larger than the smallest slice, of a transfer with no part in slices, goes
        # whole without asking the pacer (nor making one): a small request's path stays as it was.
        paceable = transfer.paced or runs.total_bytes > self.endpoint.limits.slice_bytes
        pacer = self.pacer(lane) if paceable else None
        if pacer is not None and pacer.takes(transfer, runs.total_bytes):
            # In slices, between which smaller transfers go (``runtime.pacing``).
            self.endpoint.check_running()
            token = self.endpoint.next_batch_id()
            transfer.paced.add(token)  # (before any slice of it can finish)
            pacer.add(transfer, runs, last, token)
            return token
        return self._submit_batch(transfer, lane, runs, last, inline=inline, express=express)

    def pacer(self, lane: Lane) -> Pacer | None:
        """Any thread: ``lane``'s pacer (``None``: large parts go whole, ``KVTRANSPORT_SLICE_BYTES=0``)."""
        pacer = self._pacers.get(lane.name)
        if pacer is None:
            limits = self.endpoint.limits
            if not limits.slice_bytes:
                return None
            with self._pacers_lock:
                pacer = self._pacers.get(lane.name)
                if pacer is None:
                    pacer = self._pacers[lane.name] = Pacer(
                        functools.partial(self._submit_slice, lane),
                        functools.partial(self._slice_live, lane),
                        self.endpoint.next_batch_id,
                        functools.partial(self._slice_bytes, lane),
                        limits.slices_in_flight,
                        _part_done,
                    )
        return pacer

    def _slice_bytes(self, lane: Lane) -> int:
        limits = self.endpoint.limits
        observed = list(lane.observed_bps)  # (a copy: the I/O thread appends meanwhile)
        rate = statistics.median(observed) if observed else 0.0
        return slice_size(limits.slice_bytes, limits.slice_ms / 1e3, rate)

    def _slice_live(self, lane: Lane, transfer: object) -> bool:
        t = transfer
        assert isinstance(t, Transfer)
        return not t.state.final and t.lane is lane and t.moving_to is None and not t.driver_stopped

    def _submit_slice(self, lane: Lane, transfer: object, runs: Runs, last: bool, bid: int) -> bool:
        assert isinstance(transfer, Transfer)
        if not self._slice_live(lane, transfer):
            return False
        self._submit_batch(transfer, lane, runs, last, inline=False, express=False, bid=bid)
        return True

    def slices_done(self, transfer: Transfer | None = None, bid: int = 0) -> None:
        """I/O thread: batch ``bid`` finished or failed, or ``transfer`` ended or moved: the
        lanes' pacers hand their drivers what waits (``runtime.pacing``)."""
        for pacer in list(self._pacers.values()):
            try:
                if bid:
                    pacer.finished(bid)
                if transfer is not None:
                    pacer.forget(transfer)
            except KVTransportError as exc:  # the driver's thread is gone: the endpoint is closing
                log.debug("pacing after batch %d: %s", bid, exc)

    def _submit_batch(
        self,
        transfer: Transfer,
        lane: Lane,
        runs: Runs,
        last: bool,
        *,
        inline: bool,
        express: bool,
        bid: int = 0,
    ) -> int:
        """One batch of ``transfer`` to ``lane``'s driver (``bid``: its id, given by a pacer)."""
        ep = self.endpoint
        bid = bid or (ep.next_batch_id() if len(runs) else 0)

        def noted() -> None:
            transfer.handed.discard(bid)
            if transfer.lane is not lane or (transfer.moving_to is not None and transfer.moving_to is not lane):
                return  # it moved (or is moving) to another lane meanwhile (``runtime.failover``)
            self.submitted(transfer, bid, runs.total_bytes, last)

        # A transfer of one batch: the thread that sees it finish may send "done" itself.
        express = express and bool(bid) and last and transfer.parts == 1 and self.express_done_possible()
        drivers = self.drivers

        ep.check_running()
        refused: list[ChannelDown] = []

        def submit() -> None:
            try:
                if bid:
                    drivers.submit(lane, transfer, bid, runs, noted, express)
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
                self.run(self.protocol.batch_failed(transfer, bid, error))
                self.slices_done(bid=bid)

        if bid:
            transfer.handed.add(bid)
        try:
            if inline and runs.total_bytes <= ep.limits.inline_submit_bytes:
                # On this thread when the driver allows it and its thread is idle: a small
                # request then reaches the engine with no thread hop.
                lane.runner.call_here(submit, failed)
            else:
                lane.runner.call(submit, failed)
        except BaseException:
            transfer.handed.discard(bid)  # never reached the runner
            raise
        if refused:
            # Run here, and the I/O thread would not take the batch (stopped, or backed up for
            # longer than a caller waits): the driver let go of it; the caller hears so now.
            raise EndpointDown(f"endpoint {ep.name}: {refused[0]}") from refused[0]
        return bid

    def express_done_possible(self) -> bool:
        """Whether the thread that sees a one-batch transfer finish may send its "done": on a
        one-sided session with a stream, or a two-sided one in ordered mode (where its chunks'
        notices went out on the same stream before it)."""
        if self.two_sided:
            return self.order.link is not None
        return self.express is not None

    def abort_from_caller(self, transfer: Transfer, reason: str) -> None:
        self.endpoint.call(lambda: self.run(self.protocol.abort(transfer, reason, notify=True, local=True)))

    def abort_tag_from_caller(self, tag: str, reason: str) -> None:
        """Caller's thread (``Connection.abort``): fail ``tag`` here, or tell the peer nothing of it is wanted."""
        check_tag(tag)
        t = self.protocol.transfers.get(tag)
        if t is not None and t.role == SEND:
            t.aborted_by_caller = reason or "aborted by the caller"  # nothing more of it is sent
        self.endpoint.call(lambda: self.run(self.protocol.abort_tag(tag, reason)))

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

    # -- I/O thread: events into the machine ---------------------------------------------------

    def on_expect(self, msg: Message) -> None:
        self.run(self.protocol.on_expect(msg))

    def on_done(self, msg: Message) -> None:
        # The notices that rode in it come first, as if they had come as messages of their own
        # just before it (their chunks occupy ring slots whatever became of the transfer).
        for payload in done_notices(msg):
            self.take_notice(msg["lane"], payload)
            if self.phase is Phase.CLOSED:
                return  # a notice ended the session: nothing of it is trusted any more
        if self.failover.hold_done(msg):
            return  # a failed lane is being fenced: no transfer completes before it is
        self.run(self.protocol.on_done(msg))

    def on_abort(self, msg: Message) -> None:
        self.run(self.protocol.on_abort(msg))

    def on_drained(self, msg: Message) -> None:
        if self.failover.hold_drained(msg):
            return  # pages come back only once a failed lane is fenced too
        self.run(self.protocol.on_drained(msg))

    def on_notice(self, msg: Message) -> None:
        self.take_notice(msg["lane"], msg["payload"])

    def take_notice(self, lane_name: str, payload: bytes) -> None:
        """A driver notice from the peer (a "notice" message, or one that rode in a "done")."""
        if self.failover.muted(lane_name):
            return  # a lane that failed for this peer copies nothing more into our pages
        self.drivers.take_notice(lane_name, payload)

    def submitted(self, transfer: Transfer, bid: int, nbytes: int, last: bool) -> None:
        """A chunk was handed to the driver's thread (batch ``bid``; 0 for a chunk without runs)."""
        self.run(self.protocol.chunk_submitted(transfer, bid, nbytes, last))
        if bid:
            self.failover.watch()

    def batch_finished(self, transfer: Transfer, bid: int, error: KVTransportError | None) -> None:
        lane = transfer.lane
        if error is None and bid in transfer.batches and lane is not None:
            if lane.probation and lane.canary is transfer:
                self.failover.proven(lane)
            lane.last_progress = now = time.monotonic()
            whole = transfer.whole_runs
            if (
                whole is not None
                and not transfer.failovers
                and now > transfer.submitted_at
                and transfer.last_sent
                and not transfer.batches - {bid}
            ):
                lane.observed_bps.append(whole.total_bytes / (now - transfer.submitted_at))
        self.run(self.protocol.batch_finished(transfer, bid, error))
        if self._pacers:
            self.slices_done(bid=bid)

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
        self.run(self.protocol.abort(transfer, reason, notify=notify, local=local, error=error, by_peer=by_peer))

    def send_drained(self, tag: str) -> None:
        self.run(self.protocol.confirm_drained(tag))

    def fail(self, error: KVTransportError) -> None:
        """The peer's data is unusable: the session ends, and the peer hears why."""
        self.endpoint.end_session(self, error, notify=True)

    def close(self, error: KVTransportError, *, notify: bool) -> None:
        """Fail every transfer, disconnect the driver; the endpoint then forgets the session."""
        if self.phase is Phase.CLOSED:
            return
        self.run(self.protocol.close(error, notify=notify))
        self.failover.close()
        timers = self.timers
        timers.cancel(self.heartbeat)
        timers.cancel(self.handshake_timer)
        for lane in self.lanes.values():
            if lane.connect_queued:
                try:
                    lane.runner.call(functools.partial(lane.driver.disconnect, lane.key))
                except KVTransportError:
                    pass
        self.release_receivers(set(self.lanes))
        self.ready.set()

    def release_receivers(self, keep: set[str]) -> None:
        """Disconnect the drivers that made a receive side for this connection and carry none
        of its lanes (``keep``): another driver was chosen, or the handshake failed."""
        for name in sorted(self.receivers_asked - keep):
            self.receivers_asked.discard(name)
            driver, runner = self.endpoint.drivers.get(name), self.endpoint.runners.get(name)
            if driver is not None and runner is not None:
                try:
                    runner.call(functools.partial(driver.disconnect, self.id))
                except KVTransportError:
                    pass

    # -- I/O thread: the machine's actions -----------------------------------------------------

    def run(self, actions: list[Action]) -> None:
        """Carry out what the machine answered, in order (each may feed it events in turn)."""
        for action in actions:
            match action:
                case Send(kind, fields):
                    # The machine decided it may go (it checks the phase when it decides).
                    self.send_message(kind, encode(kind, self.endpoint.max_message_bytes, **fields))
                case SetTimer(transfer, seconds, then):
                    timers = self.timers
                    timers.cancel(transfer.timer)
                    transfer.timer = None
                    if seconds is not None and then is not None:
                        transfer.timer = timers.call_later(seconds, self._feeder(then))
                case Publish(transfer):
                    lane = transfer.lane
                    if lane is not None and lane.canary is transfer and lane.probation:
                        lane.canary = None  # ended before its lane finished a batch of it: another probes
                    if self._pacers:
                        self.slices_done(transfer)
                    transfer._publish()
                case Observe(transfer, driver):
                    try:
                        self.endpoint.metrics.observe(transfer, driver, self.peer_label)
                    except Exception:
                        log.exception("counting transfer %r in the metrics failed", transfer.tag)
                case FlushNotices():
                    self.endpoint.flush_notices()
                case Arriving(delta):
                    self.endpoint.receiving(self, delta)
                case Later(seconds, then):
                    self.timers.call_later(seconds, self._feeder(then))
                case Announce(transfer, fields):
                    self._announce(transfer, fields)
                case StopWrites(transfer):
                    self.drivers.stop_writes(transfer, functools.partial(self._writes_stopped, transfer.tag))
                case CheckInbound(transfer, kind):
                    self.drivers.after_inbound(transfer, kind, functools.partial(self._inbound_checked, transfer, kind))
                case Calibrate(lane, raw_s, measured_s, runs, nbytes):
                    lane.observe(raw_s, measured_s, self.peer_label)
                    if lane.learning:
                        self._check_ranking(runs, nbytes)
                case EndSession(error, notify):
                    self.endpoint.end_session(self, error, notify=notify)
                case Fence(transfers, announced):
                    if announced:
                        self._fence(transfers)
                case FailOver(transfer, old, new, error):
                    self.failover.transfer_failed(transfer, old, new, error)
                case Next(then):
                    self.run(then())

    def _check_ranking(self, runs: int, nbytes: int) -> None:
        """I/O thread, on a connection that learns its lanes' costs: once every lane measured
        enough, say (INFO) which lane transfers like the last one now go to, when that changes."""
        lanes = self.usable_lanes()
        if any(lane.learning and len(lane.ratios) < MIN_SAMPLES for lane in lanes):
            return
        fastest = min(lanes, key=lambda lane: lane.predict(runs, nbytes))
        if fastest.name == self.fastest_lane:
            return
        figures = ", ".join(
            f"{lane.name} {nbytes / max(lane.predict(runs, nbytes), 1e-9) / 1e9:.2g} GB/s" for lane in lanes
        )
        # Transfers of several sizes may favour different lanes: at INFO once a minute at most.
        now = time.monotonic()
        quiet = now - self._ranking_logged < 60.0
        self._ranking_logged = self._ranking_logged if quiet else now
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "%s: transfers of %d bytes to %s now go via %s (measured on this connection: %s; the handshake chose %s)",
            self.endpoint.name,
            nbytes,
            self.peer_label,
            fastest.name,
            figures,
            self.decision.driver if self.decision else "?",
        )
        self.fastest_lane = fastest.name

    def _fence(self, transfers: tuple[Transfer, ...]) -> None:
        """The session ended: every lane's driver fences the peer (queued before its
        ``disconnect``), and ``transfers``, announced and never confirmed by the peer, are
        drained once every lane answered that nothing of the peer can land any more. A lane
        that cannot promise it yet is asked again, with back-off, while those pages are held
        (a peer process on this host is fenced once it has ended, say)."""
        # (a lane fenced already when the peer said it failed is not asked again: a driver keeps
        # its fenced receive sides for a while only, and would then answer False)
        lanes = [lane for lane in self.lanes.values() if lane.connect_queued and lane.name not in self.failover.fenced]
        if not lanes:
            for t in transfers:
                t.drained.set()  # no driver ever knew the peer: nothing of it could arrive
            return
        self._fence_round(lanes, transfers, FENCE_RETRY_FIRST_S, time.monotonic())

    def _fence_round(self, lanes: list[Lane], transfers: tuple[Transfer, ...], wait: float, since: float) -> None:
        unfenced: list[Lane] = []
        why: list[str] = []
        left = [len(lanes)]

        def answered(lane: Lane, fenced: Any, error: KVTransportError | None) -> None:
            if error is not None or fenced is not True:
                unfenced.append(lane)
                why.append(f"{lane.name} ({error})" if error is not None else lane.name)
            left[0] -= 1
            if left[0]:
                return
            if not unfenced:
                for t in transfers:
                    t.drained.set()
                if transfers:
                    log.info(
                        "%s: fenced; %d failed transfers' pages are free of its writes", self.peer_label, len(transfers)
                    )
                return
            holding = any(type(lane.driver).capabilities.two_sided for lane in unfenced)
            if (not transfers or all(t.drained.is_set() for t in transfers)) and not holding:
                # Nothing held (or the peer's word came another way). A two-sided driver may
                # still hold resources of the peer's until it is fenced (a staging ring's slots).
                return
            if wait == FENCE_RETRY_FIRST_S and transfers:
                log.warning(
                    "%s: %d failed transfers keep their pages: %s cannot fence the peer yet, and it never confirmed "
                    "their writes stopped; asking again with back-off",
                    self.peer_label,
                    len(transfers),
                    ", ".join(why),
                )
            if time.monotonic() - since > FENCE_GIVE_UP_S:
                log.warning("%s: gave up fencing after %.0f s; the pages stay held", self.peer_label, FENCE_GIVE_UP_S)
                return
            try:
                self.timers.call_later(
                    wait,
                    lambda: self._fence_round(unfenced, transfers, min(wait * 2, FENCE_RETRY_MAX_S), since),
                )
            except KVTransportError:
                pass  # the endpoint is closing

        for lane in lanes:
            try:
                lane.runner.call(functools.partial(lane.driver.fence, lane.key), functools.partial(answered, lane))
            except KVTransportError as exc:  # the driver is closing with its endpoint
                answered(lane, False, exc)

    def _feeder(self, event: Callable[[], list[Action]]) -> Callable[[], None]:
        return lambda: self.run(event())

    def _announce(self, transfer: Transfer, fields: dict[str, Any]) -> None:
        protocol = self.protocol
        self.drivers.expecting(
            transfer,
            protocol.expected_bytes(transfer),
            lambda: self.run(protocol.announcement_due(transfer, fields)),
            lambda: self.run(protocol.arrivals_begin(transfer)),
        )

    def _writes_stopped(self, tag: str, error: KVTransportError | None) -> None:
        self.run(self.protocol.writes_stopped(tag, error))

    def _inbound_checked(self, transfer: Transfer, kind: str, error: KVTransportError | None) -> None:
        self.run(self.protocol.inbound_checked(transfer, kind, error))

    # -- I/O thread: messages out --------------------------------------------------------------

    def send(self, kind: str, **fields: Any) -> bool:
        if self.phase is Phase.CLOSED:
            return False
        return self.send_message(kind, encode(kind, self.endpoint.max_message_bytes, **fields))

    def send_message(self, kind: str, data: bytes) -> bool:
        """I/O thread: one encoded message of type ``kind``, on the express stream in ordered
        mode (``ORDERED_KINDS``), on the control channel otherwise."""
        if kind in ORDERED_KINDS:
            if self.order.link is not None:
                sent = self.order.send(data)
                if kind == "bye":
                    self.send_frame(data)
                return sent
            self.order.sent_on_control = True
        return self.send_frame(data)

    def send_frame(self, data: bytes) -> bool:
        """One encoded message, sealed once the session is authenticated (only the
        authentication exchange itself goes out unsealed)."""
        if self.seal is not None:
            data = self.seal.seal(data)
        return self.endpoint.channel.send(self.route, data)

    # -- ordered mode (``runtime.ordered``) ------------------------------------------------------

    @property
    def ordered(self) -> ExpressLink | None:
        """The express stream that carries the ordered messages, once in ordered mode."""
        return self.order.link

    def take_ordered_mode(self, link: ExpressLink) -> bool:
        """I/O thread, when ``link`` bound: whether the session sends its ordered messages on it."""
        ordered = self.order.take(link)
        self.protocol.ordered = self.order.link is not None
        return ordered

    def express_lost(self, link: ExpressLink, why: str) -> None:
        """I/O thread: ``link`` broke or closed. In ordered mode that ends the session:
        messages may have been lost with it, and none may take another way."""
        if self.order.link is link and self.phase is not Phase.CLOSED:
            self.endpoint.end_session(
                self,
                PeerLost(f"peer {self.peer_label}: the express stream that carries its transfers' messages {why}"),
                notify=True,
            )

    def post(self, fn: Callable[[], None]) -> None:
        self.endpoint.post(fn)

    def notices_queued_for(self, peer: str) -> bool:
        return self.endpoint.notices_queued_for(peer)
