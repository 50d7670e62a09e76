"""The staged pipeline: KV pages through a bounded host ring, pipelined, with credit flow control.

Sender, per chunk (at most ``chunk_bytes`` of the request's runs):

1. take a credit (a slot of the receiver's inbound ring the receiver granted to us) and a free
   slot of our outbound ring;
2. gather the chunk's pieces from KV pages into the outbound slot (copy engine: device to
   host on a CUDA stream, or memcpy);
3. write the slot into the granted remote slot (the host driver); free the outbound slot;
4. notice the receiver: "slot s holds these pieces for these pages".

Receiver, per notice: check every piece lies inside pages a live transfer of that peer
announced (``guard``), scatter the slot into the pages (host to device), free the slot and
grant it again to whichever peer is waiting.

Three threads per pipeline, shared by every peer (gather, wire, scatter), so the gather of
chunk k+1 overlaps the wire write of chunk k and the peer's scatter of chunk k-1, and a
thousand peers cost no more threads than one. Threads that have nothing to do block without a
timeout (the gather thread wakes once more when a lent credit's hold ends). The receiver hands
out credits, never more than its inbound slots and never more than a peer asked for, plus at
most ``LEND_MAX_SLOTS`` lent ahead of an announced transfer: a slow receiver throttles the
sender and is never overrun, and a transfer larger than the ring streams through it. The
ring is split in two halves, outbound and inbound, so an endpoint that both sends and receives
cannot deadlock on its own slots. Slots a peer sits on while another waits are revoked
explicitly (``revoke``), and stay that peer's until it gives them back, uses them, or is failed
for keeping them: its write into one may be under way (see ``_reclaim_stale``).
Aborts, disconnects and close return every slot; :meth:`StagingPipeline.usage` shows it. A
stage that raises where nothing expected it fails the chunk it held and goes on.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransport.spi.errors import ConfigError, DriverError, EngineError, KVTransportError, PeerLost, ProtocolError
from kvtransport.spi.inbound import FEW_PIECES
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs, check_runs_within
from kvtransport.staging.chunks import Chunk, chunk_runs
from kvtransport.staging.config import ENV_CHUNK_BYTES, MAX_SLOTS, RingConfig
from kvtransport.staging.copy import CopyEngine, Pieces, WireLink, as_list, as_u64, shifted
from kvtransport.staging.notices import (
    MAX_HOLD_MS,
    ChunkNotice,
    Grant,
    Lend,
    Release,
    Revoke,
    Want,
    decode_notice,
    encode_chunk,
    encode_grant,
    encode_lend,
    encode_release,
    encode_revoke,
    encode_want,
)

log = logging.getLogger(__name__)

#: How long the wire stage sleeps between completion checks while writes are in flight: from
#: WIRE_POLL_MIN_S, doubling up to WIRE_POLL_S while nothing completes. Polling with a sleep, not
#: an engine's blocking wait: Mooncake's waits spin a core, and on a small host that core is the
#: one the copies need.
WIRE_POLL_MIN_S = 0.00001
WIRE_POLL_S = 0.0002
#: Except for small writes (every one in flight at most WIRE_SPIN_MAX_BYTES): for up to
#: WIRE_SPIN_S after the last post or completion the wire stage checks them back to back,
#: yielding the core between checks. A sleep here lasts 0.06-0.1 ms however short it is asked
#: to be, longer than such a write takes (measured: a 64 KiB Mooncake write polled with
#: ``sleep`` finished at a p50 of 0.24-0.39 ms, polled with ``sched_yield`` at 0.10 ms, the
#: engine's own spinning sync write at 0.11 ms).
WIRE_SPIN_S = 0.0005
WIRE_SPIN_MAX_BYTES = 256 * 1024
#: How long the thread that gathered and posted a small chunk itself (see ``submit``) checks its
#: write back to back before the wire stage takes it over. One that finishes within it has its
#: notice (and, with ordered notices, its transfer's "done") sent from that thread: the wire
#: thread is not woken at all, a wake-up that costs 0.05-0.3 ms on a small virtual machine.
INLINE_FINISH_S = 0.0005

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
class _WirePace:
    """How the wire stage waits between checks of writes in flight (see ``WIRE_POLL_S``)."""

    nap: float = WIRE_POLL_MIN_S
    spin_until: float = 0.0


@dataclass
class _ScatterUnit:
    """What one unit of the scatter stage holds: its peer, and the slot of the chunk it is
    copying in until the slot is freed (``None`` once it is)."""

    peer: str = ""
    held: tuple[_Inbound, int] | None = None


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


class StagingPipeline:
    """One endpoint's ring and pipeline for a staged driver. Public methods are called by the
    driver (from its runner thread); the stages run on the pipeline's three threads."""

    def __init__(
        self,
        name: str,
        ring_ptr: int,
        config: RingConfig,
        copy: CopyEngine,
        notify: Callable[[str, bytes], None],
        local_regions: RegionSet,
        scatter_delay: float = 0.0,
        *,
        grant_timeout: float = DEFAULT_GRANT_TIMEOUT_S,
        guard: Guard | None = None,
        completed: Callable[[int], None] | None = None,
        progress: Callable[[str], None] | None = None,
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
        self._threads = [
            threading.Thread(target=loop, name=f"{name}-{stage}", daemon=True)
            for stage, loop in (
                ("gather", self._gather_loop),
                ("wire", self._wire_loop),
                ("scatter", self._scatter_loop),
            )
        ]
        for t in self._threads:
            t.start()

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

    @property
    def threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    # -- connections --------------------------------------------------------------------------

    def connect(self, peer: str, remote: Any, link: WireLink) -> None:
        try:
            ring, slot_bytes, first = (remote[k] for k in ("ring", "slot_bytes", "inbound_first"))
            if not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in (ring, slot_bytes, first)
            ):
                raise TypeError("ring, slot_bytes and inbound_first must be non-negative integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"{self.name}: the peer's staging ring description is malformed: {exc}") from exc
        if first > MAX_SLOTS:
            raise ProtocolError(
                f"{self.name}: the peer's staging ring claims {first} inbound slots (at most {MAX_SLOTS})"
            )
        if slot_bytes < self.config.chunk_bytes:
            raise ConfigError(
                f"{self.name}: the peer's ring slots hold {slot_bytes} bytes, this side's chunks are "
                f"{self.config.chunk_bytes}; set the same {ENV_CHUNK_BYTES} on both sides"
            )
        out = _Outbound(peer, ring + first * slot_bytes, slot_bytes, first, link)
        with self._lock:
            if self._closed:
                raise DriverError(f"{self.name}: the pipeline is closed")
            self._out[peer] = out
            self._in.setdefault(peer, _Inbound())
            self._gather_rr.append(peer)

    def disconnect(self, peer: str) -> None:
        finished: list[int] = []
        with self._lock:
            out = self._out.pop(peer, None)
            inbound = self._in.pop(peer, None)
            if peer in self._gather_rr:
                self._gather_rr.remove(peer)
            if out is not None:
                out.closed = True
                out.queue.clear()
                out.credits.clear()
                out.lent.clear()
            for batch in self._batches.values():
                if batch.peer == peer and not batch.finished:
                    batch.error = PeerLost(f"{self.name}: peer {peer} went away")
                    finished.append(batch.handle)
            if inbound is not None:
                inbound.gone = True
                # Slots it held come back now (revoked ones too: see docs/staging.md for the
                # window this leaves); slots still being scattered come back when done.
                self._free_in.extend(inbound.granted)
                self._free_in.extend(inbound.revoked)
                inbound.granted.clear()
                inbound.revoked.clear()
                inbound.wants = 0
                if inbound.busy:
                    self._draining.append(inbound)
            self._wake_all()
        for handle in finished:
            self._completed(handle)
        self._grant()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop every stage (the wire stage waits for writes in flight until shortly before
        ``timeout``, then abandons them). ``True`` once no stage can touch the ring, the copy
        engine or the host engine any more, and no write reads the ring; ``False`` when a stage
        was still running after ``timeout`` (stuck inside an engine call, say; the copy engine
        is then left open too) or writes were abandoned: the caller must then not free the ring
        or close its engine, which may still use them (logged)."""
        with self._lock:
            peers = list(self._out)
        for peer in peers:
            self.disconnect(peer)
        deadline = time.monotonic() + timeout
        with self._lock:
            # Writes in flight may finish until shortly before the deadline (the ring must not
            # be freed under them); past it they are abandoned, and the caller keeps the ring.
            self._writes_until = deadline - min(1.0, timeout / 4)
            self._closed = True
            self._wake_all()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning(
                "%s: stages still running after %.0f s: %s; leaving the copy engine open",
                self.name,
                timeout,
                ", ".join(alive),
            )
            return False
        with self._lock:
            # A submitting thread still posting (stuck in the engine past the driver's stop,
            # say), or a write it posted after the wire stage ended: the ring may still be read.
            if self._inline_posting or self._posted:
                self.writes_abandoned = True
        self.copy_engine.close()
        if self.writes_abandoned:
            log.warning("%s: closed with chunk writes still in flight; the ring must stay allocated", self.name)
            return False
        return True

    # -- sender ------------------------------------------------------------------------------

    def submit(self, peer: str, runs: Runs) -> int:
        chunks = chunk_runs(runs, self.config.chunk_bytes)
        with self._lock:
            out = self._out.get(peer)
            if out is None:
                raise PeerLost(f"{self.name}: submit to {peer!r}, which is not connected")
            self._next += 1
            handle = self._next
            batch = _Batch(handle, peer, len(chunks))
            self._batches[handle] = batch
            here: tuple[_Outbound, _Job, int, int] | None = None
            need = 0
            if len(chunks) == 1 and self._inline(chunks[0]) and not out.queue and out.credits and self._free_out:
                # A small request with a credit in hand (lent ahead, say) is gathered and posted
                # right here: two stage threads' wake-ups cost more than its copy and post.
                here = self._take(out, _Job(batch, chunks[0]))
                self._inline_posting += 1  # ``close`` must know a write may start outside the stages
            else:
                out.queue.extend(_Job(batch, c) for c in chunks)
                need = len(out.queue) - len(out.credits) - out.asked
                if need > 0:
                    out.asked += need
                self._gather_cv.notify()
        if need > 0:
            self._send(peer, encode_want(need))
        if here is not None:
            self._gather_and_post(*here)
        if not chunks:
            self._completed(handle)
        return handle

    def _inline(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` may be copied on the thread at hand instead of a stage thread."""
        return (
            self.copy_engine.any_thread
            and chunk.nbytes <= INLINE_CHUNK_MAX_BYTES
            and len(chunk.length) <= INLINE_CHUNK_MAX_PIECES
        )

    def _take(self, out: _Outbound, job: _Job) -> tuple[_Outbound, _Job, int, int]:
        """Lock held: ``job`` takes a free outbound slot and one of ``out``'s credits."""
        job.batch.moving += 1
        remote = out.credits.pop(0)  # the oldest: a grant or lend nearest to being taken back
        out.lent.pop(remote, None)
        return out, job, self._free_out.pop(), remote

    def _gather_and_post(self, out: _Outbound, job: _Job, local: int, remote: int) -> None:
        """On the submitting thread: gather one chunk, post its write and check it for up to
        ``INLINE_FINISH_S``; the wire stage watches it from there if it is still moving (and
        posts it itself if posting here failed)."""
        try:
            self._gather_and_post_here(out, job, local, remote)
        finally:
            with self._lock:
                self._inline_posting -= 1

    def _gather_and_post_here(self, out: _Outbound, job: _Job, local: int, remote: int) -> None:
        if not self._gather(out, job, local, remote):
            return
        with self._lock:
            closed = self._closed
        if closed:  # no write starts once the ring may be freed
            self._abandon([(out, job, local, remote)])
            return
        try:
            token = self._post(out, job, local, remote)
        except Exception:  # noqa: BLE001 - the wire stage posts it again and fails it there
            with self._lock:
                self._wire.append((out, job, local, remote))
                self._wire_cv.notify()
            return
        until = time.monotonic() + INLINE_FINISH_S
        c = job.chunk
        notice = encode_chunk(remote, c.dst, c.length, c.offset)  # while the write is under way
        while True:
            try:
                finished = out.link.check(token)
            except Exception:  # noqa: BLE001 - the wire stage checks it again and fails it there
                break
            if finished:
                # Inside ``submit``: the core checks the batch as soon as it returns, so no
                # completion signal (it would only wake the driver's thread for nothing).
                self._written([(out, job, local, remote)], notice=notice)
                return
            if time.monotonic() >= until:
                break
            os.sched_yield()
        with self._lock:
            self._posted.append((token, out, job, local, remote))
            self._wire_cv.notify()

    def _post(self, out: _Outbound, job: _Job, local: int, remote: int) -> Any:
        """Start writing outbound slot ``local`` into the peer's slot ``remote``; its token."""
        return out.link.post(self._out_ptr(local), out.remote_ring + remote * out.remote_slot_bytes, job.chunk.nbytes)

    def _gather(self, out: _Outbound, job: _Job, local: int, remote: int, owned: list[_Work] | None = None) -> bool:
        """Copy a chunk's pieces into outbound slot ``local``; on failure fail its batch,
        return both slots (taking the chunk out of ``owned``, the stage's list of what it is
        responsible for) and say ``False``."""
        try:
            c = job.chunk
            self.copy_engine.copy(shifted(self._out_ptr(local), c.offset), c.src, c.length)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the slots come back
            with self._lock:
                job.batch.moving -= 1
                failed = self._fail(job.batch, EngineError(f"{self.name}: gathering a chunk failed: {exc}"))
                self._free_out.append(local)
                out.credits.append(remote)
                if owned is not None:
                    owned.clear()
                self._gather_cv.notify()
            if failed:
                self._completed(job.batch.handle)
            return False
        return True

    def poll(self, handle: int) -> bool:
        with self._lock:
            batch = self._batches.get(handle)
            if batch is None:
                raise DriverError(f"{self.name}: unknown handle {handle}")
            if not batch.finished:
                return False
            del self._batches[handle]
        if batch.error is not None:
            raise batch.error
        return True

    def abort(self, handle: int) -> None:
        """Forget the batch; its queued chunks are skipped (their credits kept for others), those
        being gathered or on the wire finish without a notice (``settled`` waits for them)."""
        with self._lock:
            batch = self._batches.pop(handle, None)
            if batch is not None:
                batch.aborted = True
                if batch.moving:
                    self._settling[handle] = batch
            for done in [h for h, b in self._settling.items() if not b.moving]:  # never asked: forget
                del self._settling[done]
            self._gather_cv.notify()  # its queued chunks are skipped

    def settled(self, handle: int) -> bool:
        with self._lock:
            batch = self._settling.get(handle)
            if batch is None or not batch.moving:
                self._settling.pop(handle, None)
                return True
            return False

    def _next_gather(self, releases: list[tuple[str, list[int]]]) -> tuple[_Outbound, _Job, int, int] | None:
        """Lock held: the next chunk that has a credit and a free outbound slot, round robin
        among peers; credits nothing queued will use (lent ones once their hold ends) go into
        ``releases``, for the caller to send once it has let go of the lock (sending may wait
        for the I/O thread, which takes the lock too)."""
        for _ in range(len(self._gather_rr)):
            peer = self._gather_rr[0]
            self._gather_rr.rotate(-1)
            out = self._out.get(peer)
            if out is None:
                continue
            while out.queue and out.queue[0].batch.finished:
                out.queue.popleft()  # aborted or failed: skip, keep the credit
            if out.credits and not out.queue:
                now = time.monotonic()
                spare = [s for s in out.credits if out.lent.get(s, 0.0) <= now]
                if spare:
                    out.credits = [s for s in out.credits if out.lent.get(s, 0.0) > now]
                    for s in spare:
                        out.lent.pop(s, None)
                    releases.append((out.peer, spare))
                continue
            if out.queue and out.lent:
                out.lent.clear()  # chunks wait for these credits: ordinary ones now, no hold
            if out.queue and out.credits and self._free_out:
                return self._take(out, out.queue.popleft())
        return None

    def _lent_until(self) -> float | None:
        """Lock held: when the first lent credit's hold ends (``None`` when none is held)."""
        return min((t for out in self._out.values() if not out.queue for t in out.lent.values()), default=None)

    def _gather_loop(self) -> None:
        while True:
            owned: list[_Work] = []  # the chunk this pass took, until the wire stage has it
            try:
                if not self._gather_step(owned):
                    return
            except Exception as exc:  # noqa: BLE001 - a bug or a raising callback: the stage goes on
                self._stage_failed("gather", exc, owned)

    def _gather_step(self, owned: list[_Work]) -> bool:
        """One unit of the gather stage: wait for a chunk that has a credit and an outbound slot
        (or for credits to give back), gather it and hand it to the wire stage. ``False`` once
        the pipeline is closed."""
        releases: list[tuple[str, list[int]]] = []
        with self._lock:
            while True:
                if self._closed:
                    return False
                work = self._next_gather(releases)
                if work is not None or releases:
                    break
                until = self._lent_until()
                # Lent credits unused when their hold ends go back to the receiver: wake then.
                self._gather_cv.wait(None if until is None else max(0.0, until - time.monotonic()) + 0.001)
            if work is not None:
                owned.append(work)
        for peer, slots in releases:
            self._send(peer, encode_release(slots))
        if work is None:
            return True
        if not self._gather(*work, owned):
            return True
        with self._lock:
            owned.clear()
            self._wire.append(work)
            self._wire_cv.notify()
        return True

    def _stage_failed(
        self,
        stage: str,
        exc: Exception,
        unsent: list[_Work],
        unnoticed: list[_Work] | None = None,
        noticed: list[_Work] | None = None,
    ) -> None:
        """A unit of a stage raised where nothing expected it to (a bug, or a callback of the
        core such as ``completed``): log it once, fail the batches of the chunks the unit held
        with :class:`EngineError` and give their outbound slots back, so that the stage, and
        every later transfer, goes on. Their credits: one never posted to (``unsent``) is kept
        for reuse; one written whose notice was not sent (``unnoticed``) goes back to the
        receiver unread (our write into it has completed: nothing lands there later); one whose
        notice was sent (``noticed``) comes back to the receiver after its scatter, as usual."""
        log.error("%s: the %s stage failed: %s: %s", self.name, stage, type(exc).__name__, exc, exc_info=exc)
        error = EngineError(f"{self.name}: the {stage} stage failed: {type(exc).__name__}: {exc}")
        failed: list[int] = []
        releases: list[tuple[str, list[int]]] = []
        with self._lock:
            for works, credit in ((unsent, "reuse"), (unnoticed or [], "release"), (noticed or [], "")):
                for out, job, local, remote in works:
                    job.batch.moving -= 1
                    if self._fail(job.batch, error):
                        failed.append(job.batch.handle)
                    self._free_out.append(local)
                    if credit == "reuse" and not out.closed:
                        out.credits.append(remote)
                    elif credit == "release":
                        releases.append((out.peer, [remote]))
                works.clear()
            self._gather_cv.notify()
        for peer, slots in releases:
            self._send(peer, encode_release(slots))
        try:
            self._signal(failed)
        except Exception as again:  # noqa: BLE001 - logged; the stage goes on
            log.error("%s: telling the core of batches the %s stage failed raised: %s", self.name, stage, again)

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

    def _wire_loop(self) -> None:
        inflight: list[_InFlight] = []  # posted writes being watched, across passes
        pace = _WirePace()
        while True:
            ready: list[_Work] = []  # gathered chunks taken from the queue, not posted yet
            done: list[_Work] = []  # written chunks whose notice is not sent yet
            noticed: list[_Work] = []  # written chunks whose notice was sent, not yet counted
            try:
                if not self._wire_step(inflight, ready, done, noticed, pace):
                    return
            except Exception as exc:  # noqa: BLE001 - a bug or a raising callback: the stage goes on
                self._stage_failed("wire", exc, ready, done, noticed)

    def _wire_step(
        self,
        inflight: list[_InFlight],
        ready: list[_Work],
        done: list[_Work],
        noticed: list[_Work],
        pace: _WirePace,
    ) -> bool:
        """One pass of the wire stage: post the chunks gathered since the last pass, check every
        write in flight, send the notices of those written, tell the core of batches that
        finished, then sleep (or yield) a little if none did. Once the pipeline is closed,
        nothing more is posted and the writes in flight are checked until they end or
        ``close``'s deadline nears; then they are abandoned (their batches fail, and ``close``
        says the ring must stay), so that a write that never completes cannot keep this thread
        alive. ``False`` once none is left to watch."""
        with self._lock:
            while not self._wire and not inflight and not self._posted:
                if self._closed:
                    return False
                self._wire_cv.wait()
            ready.extend(self._wire)
            self._wire.clear()
            fresh = bool(ready or self._posted)
            inflight.extend(self._posted)
            self._posted.clear()
            closed = self._closed
        if closed:
            never_posted = list(ready)
            ready.clear()  # before the batches are signalled (a raising signal must not count them twice)
            self._abandon(never_posted)  # gathered, never posted: nothing of them moves
            if inflight and time.monotonic() >= self._writes_until:
                self.writes_abandoned = True
                stuck = [(out, job, local, remote) for _, out, job, local, remote in inflight]
                inflight.clear()
                self._abandon(stuck)
            if not inflight:
                return False
            # Else the writes in flight are checked until they end: the engine still reads the
            # ring for them, so it must not be freed before.
            fresh = False
        if fresh:
            pace.spin_until = time.monotonic() + WIRE_SPIN_S
        posted = bool(ready)
        handles: list[int] = []
        while ready:
            out, job, local, remote = ready[0]
            try:
                token = self._post(out, job, local, remote)
            except Exception as exc:  # noqa: BLE001
                handles += self._wire_failed(out, job, local, remote, _as_error(self.name, exc))
            else:
                inflight.append((token, out, job, local, remote))
            ready.pop(0)
        still: list[_InFlight] = []
        failures = 0
        for token, out, job, local, remote in inflight:
            try:
                finished = out.link.check(token)
            except Exception as exc:  # noqa: BLE001
                handles += self._wire_failed(out, job, local, remote, _as_error(self.name, exc))
                failures += 1
                continue
            if finished:
                done.append((out, job, local, remote))
            else:
                still.append((token, out, job, local, remote))
        inflight[:] = still
        progressed = bool(done or failures)
        if done:
            handles += self._written(done, noticed)
        self._signal(handles)
        if progressed:
            pace.nap = WIRE_POLL_MIN_S
            pace.spin_until = time.monotonic() + WIRE_SPIN_S
        elif not posted and inflight:
            small = all(job.chunk.nbytes <= WIRE_SPIN_MAX_BYTES for _, _, job, _, _ in inflight)
            if small and time.monotonic() < pace.spin_until:
                os.sched_yield()
            else:
                time.sleep(pace.nap)
                pace.nap = min(pace.nap * 2, WIRE_POLL_S)
        return True

    def _wire_failed(self, out: _Outbound, job: _Job, local: int, remote: int, error: KVTransportError) -> list[int]:
        """A write could not be posted or failed: its batch fails, its outbound slot comes back
        and so does its credit (nothing usable landed there: reused). The batch, if this just
        failed it, for the caller to signal."""
        with self._lock:
            job.batch.moving -= 1
            failed = self._fail(job.batch, error)
            self._free_out.append(local)
            if not out.closed:
                out.credits.append(remote)
            self._gather_cv.notify()
        return [job.batch.handle] if failed else []

    def _abandon(self, works: list[_Work]) -> None:
        """The pipeline closed with these chunks gathered, or on the wire past its deadline:
        their batches fail and their outbound slots come back; nobody waits for their writes any
        more (``close`` then says so, and the driver keeps the ring and its engine)."""
        if not works:
            return
        error = DriverError(f"{self.name}: closed with {len(works)} chunk writes in flight")
        failed: list[int] = []
        with self._lock:
            for _, job, local, _ in works:
                job.batch.moving -= 1
                if self._fail(job.batch, error):
                    failed.append(job.batch.handle)
                self._free_out.append(local)
        log.debug("%s: abandoned %d chunk writes at close", self.name, len(works))
        self._signal(failed)

    def _written(
        self, done: list[_Work], noticed: list[_Work] | None = None, *, notice: bytes | None = None
    ) -> list[int]:
        """Chunks whose writes completed (wire stage, or the thread that posted one): each
        one's notice to the receiver (or, for an aborted batch, its slot back unread), moving it
        from ``done`` to ``noticed`` once sent, then its outbound slot back and its batch's
        count. The batches this completes, for the caller to signal (or not: see
        ``_gather_and_post``). ``notice``: the one chunk's notice, encoded already."""
        noticed = [] if noticed is None else noticed
        while done:
            out, job, _, remote = done[0]
            c = job.chunk
            if job.batch.aborted:
                # Nobody wants it: the receiver's slot comes back unread.
                self._send(out.peer, encode_release([remote]))
            else:
                # Sent before the batch counts the chunk written (and before an aborted batch
                # counts as settled), so the endpoint sends it before "done" (or "drained").
                self._send(out.peer, notice or encode_chunk(remote, c.dst, c.length, c.offset))
            noticed.append(done.pop(0))
        completed: list[int] = []
        with self._lock:
            starved = not self._free_out
            for _, job, local, _ in noticed:
                self._free_out.append(local)
                job.batch.moving -= 1
                job.batch.written += 1
                if job.batch.written == job.batch.chunks and not job.batch.aborted:
                    completed.append(job.batch.handle)
            noticed.clear()
            if starved:
                self._gather_cv.notify()  # it may wait for an outbound slot; none was free
        return completed

    # -- receiver ------------------------------------------------------------------------------

    def on_notice(self, peer: str, payload: bytes) -> None:
        notice = decode_notice(payload, MAX_SLOTS)
        if isinstance(notice, Grant):
            with self._lock:
                out = self._out.get(peer)
                if out is not None:
                    # Only as many credits as were asked for: a peer cannot inflate them.
                    take = [s for s in notice.slots if s < out.remote_slots][: out.asked]
                    out.asked -= len(take)
                    out.credits.extend(take)
                    self._gather_cv.notify()
            return
        if isinstance(notice, Lend):
            self._take_lent(peer, notice)
            return
        if isinstance(notice, Revoke):
            self._give_back(peer, notice)
            return
        inbound = self._in.get(peer)
        if inbound is None:
            raise ProtocolError(f"{self.name}: staging notice from unknown peer {peer}")
        if inbound.failure is not None:
            raise inbound.failure  # it kept revoked slots: the core ends its connection
        if isinstance(notice, Want):
            with self._lock:
                inbound.wants += notice.n  # a count only: slots are granted one by one as they free up
            self._grant()
        elif isinstance(notice, Release):
            with self._lock:
                for s in notice.slots:
                    if s in inbound.granted:
                        inbound.granted.pop(s, None)
                        self._free_in.append(s)
                    elif s in inbound.revoked:  # given back as asked: now it may go to another peer
                        del inbound.revoked[s]
                        self._free_in.append(s)
            self._grant()
        else:
            self._accept_chunk(peer, inbound, notice)

    def _give_back(self, peer: str, notice: Revoke) -> None:
        """Sender: the receiver took back slots it granted us (we held them unused past its
        grant timeout while another peer waited). Each one still among our credits goes back
        with a ``release`` at once, and the chunks still queued ask again; one already taken
        for a write is not ours to give back any more: its notice (or, for an aborted batch,
        its release) follows as usual, and the receiver keeps that slot for it meanwhile."""
        with self._lock:
            out = self._out.get(peer)
            if out is None:
                return
            revoked = set(notice.slots)
            back = [s for s in out.credits if s in revoked]
            if not back:
                return
            out.credits = [s for s in out.credits if s not in revoked]
            for s in back:
                out.lent.pop(s, None)
            need = sum(not job.batch.finished for job in out.queue) - len(out.credits) - out.asked
            if need > 0:
                out.asked += need
        log.info("%s: %s revoked %d unused credits; given back", self.name, peer, len(back))
        self._send(peer, encode_release(back))
        if need > 0:
            self._send(peer, encode_want(need))

    def _take_lent(self, peer: str, notice: Lend) -> None:
        """Sender: credits the receiver lent unasked, each held until used or ``hold_ms`` ends.
        Slots outside its ring or already held are ignored, and at most ``LEND_MAX_SLOTS`` lent
        credits are held at once (a lend naming more is a protocol error): a receiver cannot
        make this side hold, or scan, more than that."""
        if len(notice.slots) > LEND_MAX_SLOTS:
            raise ProtocolError(f"{self.name}: a lend of {len(notice.slots)} slots; at most {LEND_MAX_SLOTS} are lent")
        with self._lock:
            out = self._out.get(peer)
            if out is None or not notice.slots:
                return
            until = time.monotonic() + notice.hold_ms / 1000
            held = set(out.credits)
            for s in notice.slots:
                if s < out.remote_slots and s not in held and len(out.lent) < LEND_MAX_SLOTS:
                    held.add(s)
                    out.credits.append(s)
                    out.lent[s] = until
            self._gather_cv.notify()

    def lend_ahead(self, peer: str, nbytes: int) -> None:
        """Receiver: ``peer`` is about to send a transfer of ``nbytes`` (its pages were just
        announced to it). Lend it the slots its first chunks need before it asks, so a small
        transfer is written at once, with no want/grant round trip: at most
        ``LEND_MAX_SLOTS`` held per peer, never more than the transfer needs, only out of the
        half of the inbound ring that nothing holds and only while no peer waits for slots,
        so lending never delays a grant. The sender releases what it has not used when the
        hold (a quarter of ``grant_timeout``) ends; ``_reclaim_stale`` covers one that does not."""
        if nbytes <= 0:
            return
        with self._lock:
            inbound = self._in.get(peer)
            if (
                inbound is None
                or inbound.failure is not None
                or self._closed
                or any(i.wants > 0 for i in self._in.values())
            ):
                return
            spare = len(self._free_in) - (self.config.slots + 1) // 2
            n = min(-(-nbytes // self.config.chunk_bytes), LEND_MAX_SLOTS - len(inbound.granted), spare)
            if n <= 0:
                return
            now = time.monotonic()
            lent = [self._free_in.pop() for _ in range(n)]
            for s in lent:
                inbound.granted[s] = now
            self.peak_inbound = max(self.peak_inbound, self.config.slots - len(self._free_in))
        self._send(peer, encode_lend(lent, min(MAX_HOLD_MS, int(self.grant_timeout * 250))))

    def _accept_chunk(self, peer: str, inbound: _Inbound, notice: ChunkNotice) -> None:
        slot, dst, length, offset = notice.slot, notice.dst, notice.length, notice.offset
        try:
            # A revoked slot was granted, and the peer may have taken it for this chunk before
            # the revoke reached it: its chunk is accepted as any other.
            if slot not in inbound.granted and slot not in inbound.revoked:
                raise ProtocolError(f"chunk in slot {slot}, which was not granted to this peer")
            if not _within_slot(offset, length, self.config.chunk_bytes):
                raise ProtocolError("a piece reaches past its ring slot")
            if self._guard is None:
                check_runs_within(as_u64(dst), as_u64(length), self._regions.all(), "staged chunk destination")
                live = True
            else:  # the guard checks the regions too, and the pages announced to this peer
                live = self._guard(peer, dst, length)
        except KVTransportError as exc:
            error = ProtocolError(f"{self.name}: bad chunk from {peer}: {exc}; nothing of it was written")
            with self._lock:
                inbound.error = error
                if self._unhold(inbound, slot):
                    self._free_in.append(slot)
            self._progress(peer)
            self._grant()
            return
        if not live:
            log.debug("%s: dropped a late chunk from %s (its transfer had failed)", self.name, peer)
            with self._lock:
                if self._unhold(inbound, slot):
                    self._free_in.append(slot)
            self._grant()
            return
        with self._lock:
            self._unhold(inbound, slot)
            inbound.busy.add(slot)
            chunk = Chunk(shifted(self._in_ptr(slot), offset), dst, length, offset)
            # A small chunk with nothing queued before it is copied in right here: handing it to
            # the scatter thread costs a wake-up (about 0.2 ms on a cold core) against a copy of
            # a few microseconds. Bigger ones go to the scatter thread, which overlaps them with
            # the next chunk's wire write.
            here = not self._scatter and not self.scatter_delay and self._inline(chunk)
            if not here:
                self._scatter.append((inbound, peer, slot, chunk))
                self._scatter_cv.notify()
        if here:
            self._scatter_one(inbound, peer, slot, chunk)

    @staticmethod
    def _unhold(inbound: _Inbound, slot: int) -> bool:
        """Lock held: ``slot`` is no longer granted (or revoked) to ``inbound``'s peer; whether it was."""
        return inbound.granted.pop(slot, None) is not None or inbound.revoked.pop(slot, None) is not None

    def inbound_idle(self, peer: str) -> bool:
        with self._lock:
            inbound = self._in.get(peer)
            if inbound is None:
                return True
            if inbound.failure is not None:
                raise inbound.failure
            if inbound.error is not None:
                error, inbound.error = inbound.error, None
                raise error
            return not inbound.busy

    def _scatter_loop(self) -> None:
        while True:
            unit = _ScatterUnit()
            try:
                if not self._scatter_step(unit):
                    return
            except Exception as exc:  # noqa: BLE001 - a bug or a raising callback: the stage goes on
                self._scatter_failed(exc, unit)

    def _scatter_step(self, unit: _ScatterUnit) -> bool:
        """One unit of the scatter stage: copy the next accepted chunk into its pages, or, while
        a peer starves for slots or holds revoked ones, look at the grants again as they age.
        ``False`` once the pipeline is closed."""
        with self._lock:
            while not self._scatter:
                if self._closed:
                    return False
                if not (self._starving or self._revoking):
                    self._scatter_cv.wait()
                    continue
                # A peer waits for slots others hold unused, or holds revoked ones: look again
                # once they age.
                self._scatter_cv.wait(self.grant_timeout / 4)
                if not self._scatter:
                    break
            else:  # the loop ended with a chunk to copy (not by ``break``)
                inbound, peer, slot, chunk = self._scatter.popleft()
                unit.peer, unit.held = peer, (inbound, slot)
        if unit.held is None:
            self._grant()
            return True
        if self.scatter_delay:
            time.sleep(self.scatter_delay)
        self._scatter_one(inbound, peer, slot, chunk, unit)
        return True

    def _scatter_failed(self, exc: Exception, unit: _ScatterUnit) -> None:
        """A unit of the scatter stage raised where nothing expected it to (a bug, or the
        core's ``inbound_progress``): log it once; a chunk it still held was not copied in
        whole, so its peer's inbound work fails with :class:`EngineError` and its slot comes
        back; the core is told again and the slots are granted again, so the stage, and every
        later transfer, goes on."""
        log.error("%s: the scatter stage failed: %s: %s", self.name, type(exc).__name__, exc, exc_info=exc)
        if unit.held is not None:
            inbound, slot = unit.held
            with self._lock:
                self._scattered(inbound, slot, EngineError(f"{self.name}: the scatter stage failed: {exc}"))
            unit.held = None
        # Told again: a progress signal that raised may have been this chunk's only one.
        steps: list[Callable[[], None]] = [self._grant]
        if unit.peer:
            steps.insert(0, functools.partial(self._progress, unit.peer))
        for step in steps:
            try:
                step()
            except Exception as again:  # noqa: BLE001 - logged; the stage goes on
                log.error(
                    "%s: recovering from a scatter failure raised: %s: %s", self.name, type(again).__name__, again
                )

    def _scatter_one(
        self, inbound: _Inbound, peer: str, slot: int, chunk: Chunk, unit: _ScatterUnit | None = None
    ) -> None:
        """Copy one accepted chunk from its inbound slot into the pages, free the slot."""
        error: KVTransportError | None = None
        try:
            self.copy_engine.copy(chunk.dst, chunk.src, chunk.length)
        except Exception as exc:  # noqa: BLE001
            error = EngineError(f"{self.name}: scattering a chunk into KV failed: {exc}")
        with self._lock:
            self._scattered(inbound, slot, error)
            if unit is not None:
                unit.held = None
        self._progress(peer)
        self._grant()

    def _scattered(self, inbound: _Inbound, slot: int, error: KVTransportError | None) -> None:
        """Lock held: the chunk in ``slot`` is done with (copied in, or failed with ``error``)."""
        inbound.busy.discard(slot)
        if error is not None and inbound.error is None:
            inbound.error = error
        if inbound.gone and not inbound.busy and inbound in self._draining:
            self._draining.remove(inbound)
        self._free_in.append(slot)  # handed out by ``_grant``; no stage waits for it

    def _reclaim_stale(self, now: float, revokes: dict[str, list[int]], failed: list[str]) -> None:
        """Lock held. A peer waits and no slot is free: revoke the slots granted longer than
        ``grant_timeout`` ago and still unused, from every other peer (into ``revokes``, for
        the caller to send). A sender uses a credit within milliseconds of receiving it; one
        that sits on them starves the others. A revoked slot stays the holder's until it gives
        it back (a ``release``) or its chunk in it has been scattered, since its write into it
        may be under way (its outbound stuck behind a hung peer, say): granting it to anyone
        else then could scatter its bytes into their pages. A holder that does neither within
        another ``grant_timeout`` is failed (into ``failed``) and its revoked slots are freed."""
        for peer, inbound in self._in.items():
            if inbound.revoked and inbound.failure is None:
                if any(now - at > self.grant_timeout for at in inbound.revoked.values()):
                    inbound.failure = ProtocolError(
                        f"{self.name}: peer {peer} neither gave back nor used {len(inbound.revoked)} revoked "
                        f"staging slots within {self.grant_timeout:g} s"
                    )
                    failed.append(peer)
                    # Free now, not when its connection ends: a peer with no transfer under way
                    # is never asked whether it is idle, so that end could be far off, and every
                    # other peer would wait for it. (The late write of a failed holder is the
                    # window docs/staging.md describes for departed peers.)
                    self._free_in.extend(inbound.revoked)
                    inbound.revoked.clear()
        waiting = [p for p, i in self._in.items() if _starved(i)]
        if waiting and not self._free_in:
            for peer, inbound in self._in.items():
                if peer in waiting:
                    continue
                stale = [s for s, at in inbound.granted.items() if now - at > self.grant_timeout]
                for s in stale:
                    del inbound.granted[s]
                    inbound.revoked[s] = now
                if stale:
                    revokes[peer] = stale
                    log.warning(
                        "%s: revoking %d slots %s held unused for %.1f s",
                        self.name,
                        len(stale),
                        peer,
                        self.grant_timeout,
                    )
        self._revoking = any(i.revoked and i.failure is None for i in self._in.values())

    def _grant(self) -> None:
        """Hand free inbound slots to waiting peers, one at a time round robin; revoke slots
        held unused too long while a peer waits, and fail peers sitting on revoked ones."""
        grants: dict[str, list[int]] = {}
        revokes: dict[str, list[int]] = {}
        failed: list[str] = []
        with self._lock:
            self._reclaim_stale(time.monotonic(), revokes, failed)
            for peer in self._in:
                if peer not in self._rr:
                    self._rr.append(peer)
            spins = 0
            while self._free_in and self._rr and spins < len(self._rr):
                peer = self._rr[0]
                self._rr.rotate(-1)
                inbound = self._in.get(peer)
                if inbound is None:
                    self._rr.remove(peer)
                    continue
                if inbound.wants <= 0 or inbound.failure is not None:
                    spins += 1
                    continue
                spins = 0
                slot = self._free_in.pop()
                inbound.wants -= 1
                inbound.granted[slot] = time.monotonic()
                self.peak_inbound = max(self.peak_inbound, self.config.slots - len(self._free_in))
                grants.setdefault(peer, []).append(slot)
            self._starving = not self._free_in and any(map(_starved, self._in.values()))
            if self._starving or self._revoking:
                self._scatter_cv.notify()  # the scatter thread looks again as grants age
        for peer, slots in revokes.items():
            self._send(peer, encode_revoke(slots))
        for peer, slots in grants.items():
            self._send(peer, encode_grant(slots))
        for peer in failed:
            log.warning("%s: failing peer %s: it kept revoked staging slots", self.name, peer)
            try:
                self._progress(peer)  # its idle check raises the failure: the core ends its connection
            except Exception as exc:  # noqa: BLE001 - logged; the failure stays set for its next check
                log.error("%s: signalling the failure of %s raised: %s: %s", self.name, peer, type(exc).__name__, exc)

    def _send(self, peer: str, data: bytes) -> None:
        try:
            self._notify(peer, data)
        except Exception as exc:  # noqa: BLE001 - the peer is going; disconnect cleans up
            log.debug("%s: notice to %s not sent: %s", self.name, peer, exc)


def _starved(inbound: _Inbound) -> bool:
    """Lock held: whether ``inbound``'s peer waits for slots and holds none at all."""
    return inbound.wants > 0 and not inbound.granted and not inbound.busy and not inbound.revoked


def _within_slot(offset: Pieces, length: Pieces, room: int) -> bool:
    """Whether every piece ``[offset, offset + length)`` lies inside a ring slot of ``room``
    bytes. A few pieces in plain Python (its ints cannot overflow; numpy's per-call cost is
    most of a small chunk's handling); many vectorised, overflow-safe: "offset <= room and
    length <= room - offset", never "offset + length"."""
    if len(offset) <= FEW_PIECES:
        offset, length = as_list(offset), as_list(length)
        if len(offset) != len(length):
            return False
        return not offset or max(map(operator.add, offset, length)) <= room
    offset, length = as_u64(offset), as_u64(length)
    big = np.uint64(room)
    return not (np.any(offset > big) or np.any(length > big - np.minimum(offset, big)))


def _as_error(name: str, exc: BaseException) -> KVTransportError:
    return exc if isinstance(exc, KVTransportError) else EngineError(f"{name}: {type(exc).__name__}: {exc}")
