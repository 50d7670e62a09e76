"""The handles callers hold: :class:`Transfer` (one request's pages, and its state machine) and
:class:`Connection` (one negotiated peer).

States map one-to-one onto SGLang's ``KVPoll``. A sender goes Bootstrapping (waiting for the
receiver's announcement) -> WaitingForInput (announced, nothing sent yet) -> Transferring ->
Success; a receiver starts in WaitingForInput and reaches Success only once the bytes are in its
pool. Any state can go to Failed, and a final state never changes again.

Ownership: the caller's thread reads ``state`` and calls :meth:`Transfer.send`, :meth:`wait`
and :meth:`abort`; every change of state happens on the endpoint's I/O thread, through the
transfer's session. The handles know their session only as a :class:`HandleOwner`, the few
calls and facts they need of it, so this module sits below the session and the endpoint.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from kvtransport.spi.errors import KVTransportError, TransferTimeout

if TYPE_CHECKING:
    from kvtransport.negotiation.hello import Hello
    from kvtransport.negotiation.negotiate import Decision
    from kvtransport.runtime.lane import Lane
    from kvtransport.runtime.layer_groups import LayerwisePolicy
    from kvtransport.runtime.layerwise import LayerStream
    from kvtransport.runtime.timers import Timer
    from kvtransport.spi.inbound import Claim
    from kvtransport.spi.memory import KVLayout, RegionSet
    from kvtransport.spi.plan import Runs
    from kvtransport.spi.tp_map import PairShape


class State(enum.IntEnum):
    """Transfer states; the values equal SGLang's ``KVPoll``."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def final(self) -> bool:
        return self in (State.FAILED, State.SUCCESS)


SEND, RECV = "send", "recv"


class HandleOwner(Protocol):
    """What the handles ask of the session they belong to (``runtime.session.Session``).

    The caller's thread calls the methods; they validate there and queue the rest for the
    endpoint's I/O thread. The attributes are read-only snapshots for the caller."""

    id: str
    peer_label: str
    peer_address: str
    initiator: bool
    decision: Decision | None
    peer_hello: Hello | None
    peer_regions: RegionSet | None

    @property
    def error(self) -> KVTransportError | None: ...
    @property
    def transfers(self) -> dict[str, Transfer]: ...
    @property
    def endpoint(self) -> Any: ...
    @property
    def handle(self) -> Connection: ...
    @property
    def layout(self) -> KVLayout: ...
    @property
    def closed(self) -> bool: ...
    def shape(self, *, sending: bool) -> PairShape: ...
    def expect(
        self, tag: str, dst_pages: Any, aux: int | None, prefix: int = 0, state: Sequence[Any] | None = None
    ) -> Transfer: ...
    def sender(self, tag: str) -> Transfer: ...
    def abort_tag_from_caller(self, tag: str, reason: str) -> None: ...
    def close_from_caller(self, reason: str) -> None: ...
    def send_chunk(
        self, transfer: Transfer, src_pages: Any, last: bool, aux: int | None, state: Sequence[Any] | None = None
    ) -> None: ...
    def send_layerwise(
        self,
        transfer: Transfer,
        src_pages: Any,
        last: bool,
        aux: int | None,
        state: Sequence[Any] | None,
        policy: LayerwisePolicy | None,
        region_layers: Sequence[int] | None,
    ) -> LayerStream: ...
    def abort_from_caller(self, transfer: Transfer, reason: str) -> None: ...


class Transfer:
    """One request's pages over one connection, as the sender or the receiver sees it."""

    def __init__(self, session: HandleOwner, tag: str, role: str, state: State) -> None:
        self._session = session
        self.tag = tag
        self.role = role  # SEND or RECV
        self._state = state
        self._since = time.monotonic()
        self.created = self._since
        self.counted = False  # I/O thread: counted in the endpoint's metrics (once, when final)
        self.error: KVTransportError | None = None
        self._final = threading.Event()
        # sender side
        self.dst_pages: npt.NDArray[np.int64] | None = None
        #: The same, as a list, when they are few (a small request plans from lists).
        self.dst_page_list: list[int] | None = None
        self.dst_aux = -1
        self.dst_state: tuple[npt.NDArray[np.int64], ...] = ()  # per state group
        self.sent_pages = 0  # caller thread: pages planned so far
        self.last_planned = False  # caller thread: the last chunk was planned
        #: Caller threads: held while a chunk or a layer group is planned and handed to its
        #: driver, so the transfer's parts reach the driver in the order they were counted.
        self.plan_lock = threading.Lock()
        #: Layer-wise sends of this transfer with groups still to post (``runtime.layerwise``):
        #: the transfer's last part is the one that leaves none.
        self.open_streams = 0
        self.parts = 0  # chunks and layer groups planned so far
        #: Caller threads: the reason the caller aborted it, set before the abort is queued,
        #: so that nothing is planned or posted after :meth:`abort` returned.
        self.aborted_by_caller = ""
        # I/O thread
        self.last_sent = False  # the last chunk was handed to the driver
        self.batches: set[int] = set()  # batch ids in the driver, not finished yet
        self.bytes = 0
        self.peer_done = False  # receiver: the sender said every byte was written
        self.peer_prefix = 0  # sender: how much the receiver holds already (its announcement)
        self.driver_stopped = False  # sender, driver thread only: aborted there, submit nothing more
        #: Sender: the one-batch transfer's "done" went out on the express stream (set by the
        #: thread that saw the batch finish), and the I/O thread started failing it (``stopping``);
        #: whichever comes first under ``express_lock`` wins.
        self.express_lock = threading.Lock()
        self.done_sent = False
        self.stopping = False
        #: Receiver: set once nothing of this transfer can be written into the announced pages
        #: any more: it succeeded, or it failed and the sender confirmed its writes settled
        #: (``drained``). A serving engine frees the pages of a failed request only then.
        self.drained = threading.Event()
        self.announced: Claim | None = None  # receiver: what it announced, until it ends
        #: Receiver, I/O thread: counted among the endpoint's arriving transfers (its drivers
        #: are driven while any is), from its announcement until nothing more of it can arrive.
        self.arriving = False
        self.filed = False  # filed under its tag in the session
        self.timer: Timer | None = None  # its state's timeout, or when it is forgotten
        self.started = 0.0
        self.finished = 0.0
        #: Sender: the driver the transfer takes (picked at its first chunk by predicted time
        #: among the connection's lanes); receiver: the driver its "done" named.
        self.driver = ""
        #: Sender: what the lane's cost models predicted for its first chunk (0: no model), and
        #: the seconds from that chunk's submission to Success (0 until then).
        self.predicted_s = 0.0
        self.raw_predicted_s = 0.0  # uncorrected, for a one-chunk transfer: what the lane checks
        self.runs = 0  # a one-chunk transfer's descriptors (with raw_predicted_s)
        self.measured_s = 0.0
        self.submitted_at = 0.0
        self.lane: Lane | None = None
        #: Sender: the runs of every part handed to a driver so far, each with whether it was
        #: the last (what a failover sends again; emptied once the transfer is final), when the
        #: latest was, how often it moved to another lane, and when it last did
        #: (``runtime.failover``).
        self.sent_parts: list[tuple[Runs, bool]] = []
        #: The generation of its lane when it took it (``Lane.gen``): a failure of a batch of
        #: an earlier generation moves it without taking the lane as it is now down.
        self.lane_gen = 0
        #: The tokens of its parts a lane's pacer holds in slices, until no slice of each waits
        #: or is in the driver (``runtime.pacing``; a layer-wise group's "batch" is its token).
        self.paced: set[int] = set()
        #: Its batches handed to a lane's runner whose ``submit`` has not been noted yet (their
        #: source pages are about to be read: a layer-wise stream is not settled meanwhile).
        self.handed: set[int] = set()
        self.last_part_at = 0.0
        self.failovers = 0
        self.failed_over_at = 0.0
        self.failed_over_from = ""  # the lane it first failed on
        #: Sender, under ``express_lock``: it moved to another lane; no "done" of a batch of the
        #: old lane goes out on the express stream any more.
        self.moved = False
        #: Sender, I/O thread: the lane a move is taking it to while that move waits for its plan
        #: lock (``runtime.failover``): news of its old lane's parts no longer counts meanwhile.
        self.moving_to: Lane | None = None

    @property
    def whole_runs(self) -> Runs | None:
        """Sender: the runs of a transfer sent in one part (``None`` for one in several)."""
        parts = self.sent_parts
        return parts[0][0] if len(parts) == 1 and parts[0][1] else None

    @property
    def connection(self) -> Connection:
        return self._session.handle

    @property
    def state(self) -> State:
        return self._state

    def poll(self) -> State:
        return self._state

    def __repr__(self) -> str:
        return f"<Transfer {self.role} {self.tag!r} {self._state.name}>"

    def wait(self, timeout: float | None = None) -> State:
        """Block until Success or Failed. Raises the transfer's error on failure, and
        :class:`TransferTimeout` if ``timeout`` passes first (the transfer goes on)."""
        if not self._final.wait(timeout):
            raise TransferTimeout(f"transfer {self.tag!r} still {self._state.name} after {timeout} s")
        if self._state is State.FAILED:
            assert self.error is not None
            raise self.error
        return self._state

    def send(
        self, src_pages: Any, *, last: bool = True, aux: int | None = None, state: Sequence[Any] | None = None
    ) -> None:
        """Write the next chunk of source pages (sender). They land on the destination pages
        the receiver announced, in order. The last chunk also carries the aux slot and, per
        state group, the source items (``state[g]``: as many as the receiver announced for
        group ``g``). Bad indices raise here; nothing is submitted."""
        if self.role != SEND:
            raise KVTransportError("send() on a receiving transfer")
        self._session.send_chunk(self, src_pages, last, aux, state)

    def send_layerwise(
        self,
        src_pages: Any,
        *,
        last: bool = True,
        aux: int | None = None,
        state: Sequence[Any] | None = None,
        policy: LayerwisePolicy | None = None,
        region_layers: Sequence[int] | None = None,
    ) -> LayerStream:
        """Send the next chunk of source pages layer group by layer group, as prefill computes
        them (sender; docs/layerwise.md). The pages, ``last``, ``aux`` and ``state`` mean what
        they mean for :meth:`send`, and are checked here; the returned stream's
        :meth:`~kvtransport.runtime.layerwise.LayerStream.layer_ready` marks each layer, and
        the stream posts groups of ready layers as they fill. ``policy``: how layers are
        grouped (default: ``LayerwisePolicy.from_env()``); ``region_layers``: the layer of each
        KV region, when the layout does not tell (``layer_groups.region_layers``)."""
        if self.role != SEND:
            raise KVTransportError("send_layerwise() on a receiving transfer")
        return self._session.send_layerwise(self, src_pages, last, aux, state, policy, region_layers)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fail this transfer here and at the peer. Once it returns, nothing more of it is
        sent: a later :meth:`send` (or a layer-wise send's next group) raises
        :class:`~kvtransport.spi.errors.TransferAborted`."""
        self.aborted_by_caller = reason or "aborted by the caller"
        self._session.abort_from_caller(self, reason)

    # -- I/O thread ------------------------------------------------------------------------

    def _set(self, state: State, error: KVTransportError | None = None) -> bool:
        """Move to ``state``; ``False`` (and nothing changes) once the transfer is final. The
        session's protocol machine calls it, acts on the change, then :meth:`_publish`."""
        if self._state.final:
            return False  # a failed transfer is never reported as a success later
        if error is not None:
            self.error = error  # before the state: a caller that sees Failed finds its error
        self._state = state
        self._since = time.monotonic()
        if state is State.TRANSFERRING and not self.started:
            self.started = self._since
        if state.final:
            self.finished = self._since
        return True

    def _publish(self) -> None:
        """Wake whoever waits for the final state (after the session acted on the change:
        its timers, the metrics, the guard of its pages)."""
        if self._state is State.SUCCESS and self.role == RECV:
            self.drained.set()  # every write of it completed
        if self._state.final:
            self._final.set()


class Connection:
    """A read-only handle on a negotiated link to one peer (what callers hold)."""

    def __init__(self, session: HandleOwner) -> None:
        self._session = session

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def endpoint(self) -> Any:
        """The :class:`~kvtransport.runtime.endpoint.Endpoint` this connection belongs to."""
        return self._session.endpoint

    @property
    def decision(self) -> Decision | None:
        return self._session.decision

    @property
    def peer_label(self) -> str:
        return self._session.peer_label

    @property
    def peer_address(self) -> str:
        return self._session.peer_address

    @property
    def peer_endpoint(self) -> str:
        """The peer endpoint's name, as its (authenticated) hello gives it."""
        hello = self._session.peer_hello
        return hello.endpoint if hello is not None else ""

    @property
    def peer_host_id(self) -> str:
        """The peer's host id, as its (authenticated) hello gives it."""
        hello = self._session.peer_hello
        return hello.host.host_id if hello is not None else ""

    @property
    def layout(self) -> KVLayout:
        """This side's KV layout (its endpoint's)."""
        return self._session.layout

    def pair_shape(self, *, sending: bool) -> PairShape:
        """What this side writes into the peer's pages (``sending``) or the peer into this
        side's, under unequal TP (``tp_map.pair_shape``)."""
        return self._session.shape(sending=sending)

    @property
    def peer_layout(self) -> KVLayout | None:
        """The peer's KV layout (TP rank and size among it), as its hello gives it."""
        hello = self._session.peer_hello
        return hello.layout if hello is not None else None

    @property
    def peer_regions(self) -> RegionSet | None:
        return self._session.peer_regions

    @property
    def initiator(self) -> bool:
        return self._session.initiator

    @property
    def alive(self) -> bool:
        return not self._session.closed

    @property
    def error(self) -> KVTransportError | None:
        return self._session.error

    @property
    def transfers(self) -> dict[str, Transfer]:
        """A snapshot of the transfers filed under their tags now."""
        return dict(self._session.transfers)

    def expect(
        self,
        tag: str,
        dst_pages: Any,
        *,
        aux: int | None = None,
        prefix: int = 0,
        state: Sequence[Any] | None = None,
    ) -> Transfer:
        """Receiver: pages of transfer ``tag`` go to ``dst_pages`` (and aux slot ``aux``).
        ``prefix`` tells the sender how much of the sequence this side holds already (its
        ``Transfer.peer_prefix``; the unit is the application's): ``dst_pages`` are for what
        follows it. ``state[g]``: the items of state group ``g`` (window pages, a slot) the
        sender's last chunk fills (missing or empty: none of that group)."""
        return self._session.expect(tag, dst_pages, aux, prefix, state)

    def sender(self, tag: str) -> Transfer:
        """Sender: the transfer ``tag``; it waits for the receiver's announcement."""
        return self._session.sender(tag)

    def transfer(self, tag: str) -> Transfer | None:
        return self._session.transfers.get(tag)

    def abort(self, tag: str, reason: str) -> None:
        """Fail transfer ``tag`` on this connection, or, if this side has not created it (a
        receiver that gives up before announcing its pages), tell the peer that nothing of it
        is wanted: its sender fails at once, now or when it is created. Returns at once."""
        self._session.abort_tag_from_caller(tag, reason)

    def close(self, reason: str = "closed by the caller") -> None:
        """End this connection: the peer is told (``bye``), its transfers here fail with
        :class:`~kvtransport.spi.errors.TransferAborted`, the driver forgets the peer. Idempotent."""
        self._session.close_from_caller(reason)

    def __repr__(self) -> str:
        driver = self.decision.driver if self.decision else "?"
        return f"<Connection {self.id} to {self.peer_label} via {driver}>"
