"""The staged pipeline's shared state: the records of batches, chunks and peers, the lock over
them, and the ring's slot accounting.

Owns :class:`RingState`, the base of every part of ``StagingPipeline``: the one lock and the
three stage conditions over it; the free outbound and inbound slots; the peers (an
:class:`_Outbound` for sending to each, an :class:`_Inbound` for receiving from each), the
batches and the queues between the stages; the ring's geometry and what of it is in use
(``describe``, ``usage``, ``pending``); and the helpers both sides use (``_inline``, ``_fail``,
``_signal``, ``_wake_all``, ``_send``). Also the records those tables hold (:class:`RingUsage`,
``_Batch``, ``_Job``, ``_Outbound``, ``_Inbound``) and the limits both sides read
(``INLINE_CHUNK_MAX_*``, ``LEND_MAX_SLOTS``, ``DEFAULT_GRANT_TIMEOUT_S``).

The pipeline's parts are classes of one object, not helper objects it composes:
``wire_stage.WireStage`` and ``sending.SendingSide`` (the sender) and ``receiving.ReceivingSide``
(the receiver) derive from :class:`RingState`, and ``pipeline.StagingPipeline`` from both
sides. Every stage and every driver call works under the one lock on the same tables, and the
pipeline's settings and the core's callbacks (``copy_engine``, ``grant_timeout``,
``_completed``, ``_progress``) are looked up on the pipeline when used, so one replaced on it
(the tests do) takes effect in every part, as it did when they were one class.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtransport.spi.errors import KVTransportError
from kvtransport.spi.memory import RegionSet
from kvtransport.staging.chunks import Chunk
from kvtransport.staging.config import RingConfig
from kvtransport.staging.copy import CopyEngine, Pieces, WireLink

#: The pipeline's one logger, whichever of its parts logs (logging configurations select it by
#: this name).
log = logging.getLogger("kvtransport.staging.pipeline")

#: Largest chunk the receiver copies in on the thread that accepted its notice (see
#: ``_accept_chunk``), and the sender gathers and posts on the thread that submitted it (see
#: ``submit``), when nothing is queued before it; larger ones go to the stage threads, which
#: overlap them with the next chunk. As large as the batches the direct drivers post on their
#: caller's thread (``KVTRANSPORT_INLINE_SUBMIT_BYTES``): a 2 MiB request handed to the stage
#: threads paid three wake-ups (gather, scatter, then the runner to see the scatter end), each
#: 0.1-0.3 ms here, against 0.1-0.5 ms for copying it on the thread at hand (measured, nixl-staged,
#: 2 MiB: gap to raw 2.6-3.3 ms with 256 KiB here, 1.7-2.3 ms with 2 MiB). Holds the receiver's
#: I/O thread for at most one such copy, and only while its scatter stage is idle.
INLINE_CHUNK_MAX_BYTES = 2 << 20
#: ... and at most this many pieces (the checks and copies of a chunk cost per piece, and the
#: receiving thread may be the endpoint's I/O thread).
INLINE_CHUNK_MAX_PIECES = 256

#: Seconds a granted slot may sit unused before it is taken back for a peer that waits.
DEFAULT_GRANT_TIMEOUT_S = 2.0

#: Most inbound slots lent to one peer ahead of its transfers (see ``lend_ahead``).
LEND_MAX_SLOTS = 2

#: ``guard(peer, dst, length)``: ``True`` when the pieces land where ``peer`` may write, ``False``
#: for late data of a transfer that failed (dropped); raises for anything else.
Guard = Callable[[str, Pieces, Pieces], bool]


@dataclass
class RingUsage:
    """Slots in use now: outbound (ours, being filled or written), granted to peers (credits
    not yet used, revoked ones not yet given back included), busy (holding a peer's chunk until
    its scatter completes)."""

    outbound: int
    granted: int
    busy: int

    @property
    def total(self) -> int:
        return self.outbound + self.granted + self.busy


@dataclass
class _Batch:
    handle: int
    peer: str
    chunks: int
    written: int = 0
    error: KVTransportError | None = None
    aborted: bool = False
    #: Chunks being gathered or on the wire (their notice not sent yet): an aborted batch has
    #: settled only when none is left.
    moving: int = 0

    @property
    def finished(self) -> bool:
        return self.error is not None or self.aborted or self.written == self.chunks


@dataclass
class _Job:
    batch: _Batch
    chunk: Chunk


@dataclass
class _Outbound:
    """Sending to one peer: its ring geometry, queued chunks and credits."""

    peer: str
    remote_ring: int
    remote_slot_bytes: int
    remote_slots: int
    link: WireLink
    queue: collections.deque[_Job] = field(default_factory=collections.deque)
    credits: list[int] = field(default_factory=list)
    asked: int = 0  # credits requested and not yet granted
    #: Credits the receiver lent unasked (a subset of ``credits``): slot -> when it must be
    #: released if still unused.
    lent: dict[int, float] = field(default_factory=dict)
    closed: bool = False


#: A chunk that holds an outbound slot and a credit: (peer, job, outbound slot, remote slot).
_Work = tuple[_Outbound, _Job, int, int]
#: A chunk whose write was posted: (the link's token, *_Work).
_InFlight = tuple[Any, _Outbound, _Job, int, int]


@dataclass
class _Inbound:
    """Receiving from one peer: what it asked for, which slots it holds, what is being scattered."""

    wants: int = 0
    granted: dict[int, float] = field(default_factory=dict)  # slot -> when it was granted
    #: Slots taken back from it (``_reclaim_stale``) that it has not given back or used yet:
    #: slot -> when the revoke was sent. Still its own (it may be writing one now): neither
    #: free nor grantable until its release, its chunk's scatter, its failure for keeping them,
    #: or its connection's end.
    revoked: dict[int, float] = field(default_factory=dict)
    busy: set[int] = field(default_factory=set)
    error: KVTransportError | None = None
    #: Set once it kept revoked slots past their deadline (they are freed then): every later
    #: notice and idle check of it raises this, so the core ends its connection.
    failure: KVTransportError | None = None
    gone: bool = False


class RingState:
    """What every part of the pipeline shares (see the module's docstring). A method that says
    "Lock held" expects its caller to hold ``_lock``."""

    def __init__(
        self,
        name: str,
        ring_ptr: int,
        config: RingConfig,
        copy: CopyEngine,
        notify: Callable[[str, bytes], None],
        local_regions: RegionSet,
        scatter_delay: float,
        *,
        grant_timeout: float,
        guard: Guard | None,
        completed: Callable[[int], None] | None,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.name = name
        self.scatter_delay = scatter_delay
        self.grant_timeout = grant_timeout
        self._starving = False
        #: Some peer holds revoked slots (not yet past their deadline): the scatter thread looks
        #: again as they age, so that a peer sitting on them is failed within a bounded time.
        self._revoking = False
        #: Most inbound slots ever held by peers at once (granted or busy); never above ``slots``.
        self.peak_inbound = 0
        self.ring_ptr = ring_ptr
        self.config = config
        self.copy_engine = copy
        self._notify = notify
        self._regions = local_regions
        self._guard = guard
        self._completed = completed or (lambda handle: None)
        self._progress = progress or (lambda peer: None)
        slots = config.slots
        # Fault the ring in now, not in the middle of the first transfer.
        ctypes.memset(ring_ptr, 0, 2 * slots * config.chunk_bytes)
        # One lock for the pipeline's state; each stage thread waits on a condition of its own
        # over it, woken only by a change that may give it work: a small request handled on
        # the threads at hand wakes none of them (each needless wake-up took the interpreter
        # from the thread moving the request, several times per request).
        self._lock = threading.RLock()
        self._gather_cv = threading.Condition(self._lock)
        self._wire_cv = threading.Condition(self._lock)
        self._scatter_cv = threading.Condition(self._lock)
        self._free_out = list(range(slots))
        self._free_in = list(range(slots))
        #: Set by the wire stage when the pipeline closed with writes still in flight past
        #: ``close``'s deadline: the ring and the engine must then outlive the pipeline.
        self.writes_abandoned = False
        self._writes_until = 0.0
        #: Submitting threads gathering or posting a chunk themselves (see ``submit``).
        self._inline_posting = 0
        self._out: dict[str, _Outbound] = {}
        self._in: dict[str, _Inbound] = {}
        self._draining: list[_Inbound] = []  # peers gone with chunks still being scattered
        #: Inbound slots of departed peers the driver could not fence yet: the peer's engine may
        #: still write into them, so they go to nobody else until ``release_held``.
        self._held_in: dict[str, list[int]] = {}
        self._batches: dict[int, _Batch] = {}
        self._settling: dict[int, _Batch] = {}  # aborted batches with chunks still moving
        self._next = 0
        self._rr: collections.deque[str] = collections.deque()
        self._gather_rr: collections.deque[str] = collections.deque()
        self._wire: collections.deque[_Work] = collections.deque()
        #: Chunks a submitting thread posted itself (see ``submit``): the wire stage watches them.
        self._posted: collections.deque[_InFlight] = collections.deque()
        self._scatter: collections.deque[tuple[_Inbound, str, int, Chunk]] = collections.deque()
        self._closed = False

    # -- geometry --------------------------------------------------------------------------------

    def _out_ptr(self, slot: int) -> int:
        return self.ring_ptr + slot * self.config.chunk_bytes

    def _in_ptr(self, slot: int) -> int:
        return self.ring_ptr + (self.config.slots + slot) * self.config.chunk_bytes

    def describe(self) -> dict[str, int]:
        """What a peer needs to write into this ring (goes into the driver's connection info)."""
        return {"ring": self.ring_ptr, "slot_bytes": self.config.chunk_bytes, "inbound_first": self.config.slots}

    def usage(self) -> RingUsage:
        with self._lock:
            slots = self.config.slots
            return RingUsage(
                outbound=slots - len(self._free_out),
                granted=sum(len(i.granted) + len(i.revoked) for i in self._in.values()),
                busy=sum(len(i.busy) for i in (*self._in.values(), *self._draining)),
            )

    def pending(self) -> int:
        with self._lock:
            return len(self._batches)

    # -- what both sides use ------------------------------------------------------------------

    def _inline(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` may be copied on the thread at hand instead of a stage thread."""
        return (
            self.copy_engine.any_thread
            and chunk.nbytes <= INLINE_CHUNK_MAX_BYTES
            and len(chunk.length) <= INLINE_CHUNK_MAX_PIECES
        )

    def _signal(self, handles: list[int]) -> None:
        """Tell the core these batches finished: each one, even when telling another raised
        (the first such error is raised once all were told)."""
        error: Exception | None = None
        for handle in handles:
            try:
                self._completed(handle)
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                error = error or exc
        if error is not None:
            raise error

    def _wake_all(self) -> None:
        """Lock held: every stage looks again (a peer left, or the pipeline closes)."""
        for cv in (self._gather_cv, self._wire_cv, self._scatter_cv):
            cv.notify()

    def _fail(self, batch: _Batch, error: KVTransportError) -> bool:
        """Lock held. ``True`` when the batch just failed: the caller then reports it with
        ``_completed`` once it has released the lock (the core may poll right there)."""
        if batch.finished:
            return False
        batch.error = error
        return True

    def _send(self, peer: str, data: bytes) -> None:
        try:
            self._notify(peer, data)
        except Exception as exc:  # noqa: BLE001 - the peer is going; disconnect cleans up
            log.debug("%s: notice to %s not sent: %s", self.name, peer, exc)
