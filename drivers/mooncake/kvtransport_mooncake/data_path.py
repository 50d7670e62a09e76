"""The Mooncake data path of ``mooncake-gdr``: one engine per endpoint, regions registered
once, the planner's runs written as one Mooncake request each.

``submit`` and ``poll`` run on the core's runner thread, which must not block. A small batch (at
most ``INLINE_RUNS`` runs, e.g. one request's pages of a few layers) is posted right there and
``poll`` checks its requests (the runner polls it back to back for a moment, then with back-off):
no thread hop on the way. A large batch runs on a small worker pool, which posts (up to
``KVTRANSPORT_MOONCAKE_MAX_BATCH`` in flight) and polls with short, growing sleeps, and tells
the core through ``context.completed`` when it is done. Both check a batch's requests oldest
first and stop at the first one still running: each check releases and retakes the interpreter
lock, and checking every request in flight on each pass (up to 1,024) took the CPU the engine's
own threads need. Neither uses Mooncake's blocking calls
(``batch_transfer_sync_write``, ``get_batch_transfer_status``): they spin a CPU core while they
wait (measured 1.35-1.7x slower than posting and polling on the same runs here). Mooncake cannot
cancel a posted request: ``abort`` releases the handle at once, stops a worker before it posts
more and leaves what was posted to finish on a worker; bytes already posted land in the peer's
registered region, never outside it, and ``settled`` answers ``False`` until they have (the core
then tells the receiver its pages are free of writes).

Receiving, each peer writes into an engine of its own, with this endpoint's regions registered
(``receive_info``), which ``fence`` cuts off alone (``engine.Receivers`` says how).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack

from kvtransport.spi.driver import FENCE_WAIT_S, DriverContext, KVTransport
from kvtransport.spi.errors import DriverError, EngineError, KVTransportError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs

from .engine import Engine, Receivers

log = logging.getLogger(__name__)

#: Batches in flight at once. Two keep the engine busy while the next batch is being posted,
#: and stay under Mooncake's per-lane queue limit with the default batch size.
WORKERS = 2
#: How long ``close`` waits for posted batches to drain before releasing the engine.
CLOSE_GRACE_S = 10.0
#: Batches of at most this many runs are posted at submit and polled, without a worker.
INLINE_RUNS = 64


@dataclass
class _Job:
    """A large batch, written by a worker."""

    peer: str
    future: Future[None]
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Inline:
    """A small batch, posted at submit; ``poll`` checks its requests."""

    peer: str
    posted: list[int]


class MooncakeDataPath(KVTransport):
    """Moves bytes with a Mooncake engine; subclasses declare name, capabilities and offer."""

    #: Small batches are posted at once and polled (by the core's runner, which spins briefly);
    #: large ones are written by a worker, whose future signals the core when it is done.
    signals_completion: ClassVar[bool] = False
    #: Posting (or queueing for the pipeline) never blocks, and the engine takes calls from any thread.
    thread_agnostic: ClassVar[bool] = True

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        self._engine: Engine | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._peers: dict[str, str] = {}  # peer -> Mooncake session id
        self._jobs: dict[int, _Job | _Inline] = {}
        self._running: set[Future[None]] = set()
        #: Aborted handles whose posted writes are still finishing (Mooncake cannot cancel them).
        self._settling: dict[int, Future[None]] = {}
        self._next = 0
        self._regions: RegionSet | None = None
        #: The engines peers write into, one each (``receive_info``), and their fences.
        self._receivers = Receivers(
            self.name,
            lambda: self.context.host,
            self._receiving_memory,
            lambda: self._regions.kv_kind.device if self._regions is not None else None,
        )

    def open(self, regions: RegionSet) -> bytes:
        if self._engine is not None:
            raise DriverError(f"{self.name}: open() called twice")
        engine = Engine(self.name, self.context.host, regions.kv_kind.device)
        try:
            regs = regions.all()
            engine.register([r.ptr for r in regs], [r.length for r in regs])
        except KVTransportError:
            engine.close()
            raise
        self._engine = engine
        self._regions = regions
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix=f"{self.name}-write")
        return _info(engine)

    def receive_info(self, peer: str) -> bytes:
        if self._engine is None or self._regions is None:
            raise DriverError(f"{self.name}: receive_info() before open()")
        return _info(self._receivers.create(peer))

    def _receiving_memory(self) -> tuple[list[int], list[int]]:
        """What a receive engine registers: every region (KV, aux, state)."""
        assert self._regions is not None
        regs = self._regions.all()
        return [r.ptr for r in regs], [r.length for r in regs]

    def fence(self, peer: str) -> bool:
        return self._receivers.fence(peer, FENCE_WAIT_S)

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        if self._engine is None:
            raise DriverError(f"{self.name}: connect() before open()")
        try:
            doc = msgpack.unpackb(info)
            session, protocol = str(doc["session"]), str(doc["protocol"])
            host, _, port = session.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"session {session!r} is not host:port")
        except Exception as exc:
            raise DriverError(f"{self.name}: the peer's connection info is not a Mooncake session: {exc}") from exc
        mine = {self._engine.session, *self._receivers.sessions()}
        if session in mine or session in self._peers.values():
            raise DriverError(
                f"{self.name}: the peer's Mooncake session {session} is this endpoint's or another peer's"
            )
        if protocol != self._engine.protocol:
            raise DriverError(
                f"{self.name}: the peer's engine runs {protocol}, this one {self._engine.protocol}; "
                "they cannot talk to each other"
            )
        self._peers[peer] = session

    def submit(self, peer: str, runs: Runs) -> int:
        session = self._peers.get(peer)
        if session is None or self._engine is None or self._pool is None:
            raise DriverError(f"{self.name}: submit to {peer!r} before open()/connect()")
        engine = self._engine
        src, dst, lengths = runs.lists()
        self._next += 1
        handle = self._next
        if len(src) <= INLINE_RUNS:
            # A handful of requests: posting them here costs less than handing them to a worker.
            posted: list[int] = []
            try:
                for s, d, n in zip(src, dst, lengths, strict=True):
                    posted.append(engine.post(session, s, d, n))
            except BaseException:
                # The core gets no handle to ask ``settled`` about: wait here for what was
                # posted (a handful of writes), so nothing of it lands after the failure. Any
                # failure, not only a refusal: the binding can raise its own errors too.
                engine.drain(posted)
                raise
            self._jobs[handle] = _Inline(peer, posted)
            return handle
        cancelled = threading.Event()

        future = self._pool.submit(engine.write_polled, session, src, dst, lengths, engine.max_batch, cancelled)
        self._jobs[handle] = _Job(peer, future, cancelled)
        self._running.add(future)
        context = self.context

        def finished(f: Future[None]) -> None:
            self._running.discard(f)
            context.completed(handle)

        future.add_done_callback(finished)
        return handle

    def _drain(self, posted: list[int]) -> Future[None] | None:
        """Posted requests a batch no longer waits for (failed or aborted) finish on a worker."""
        if posted and self._engine is not None and self._pool is not None:
            future = self._pool.submit(self._engine.drain, list(posted))
            self._running.add(future)
            future.add_done_callback(self._running.discard)
            return future
        return None

    def poll(self, handle: int) -> bool:
        job = self._jobs.get(handle)
        if job is None:
            raise DriverError(f"{self.name}: unknown handle {handle}")
        if isinstance(job, _Inline):
            assert self._engine is not None
            # Oldest first, up to the first still running (as the workers do): the runner
            # polls back to back for a moment, and each call must stay a few checks.
            try:
                self._engine.reap(job.posted)
            except KVTransportError:
                del self._jobs[handle]
                draining = self._drain(job.posted)
                if draining is not None:  # the core asks ``settled`` before it confirms
                    self._settling[handle] = draining
                raise
            if job.posted:
                return False
            del self._jobs[handle]
            return True
        if not job.future.done():
            return False
        del self._jobs[handle]
        exc = job.future.exception()
        if exc is None:
            return True
        if isinstance(exc, KVTransportError):
            raise exc
        raise EngineError(f"{self.name}: Mooncake write failed: {type(exc).__name__}: {exc}") from exc

    def abort(self, handle: int) -> None:
        job = self._jobs.pop(handle, None)
        if isinstance(job, _Inline):
            draining = self._drain(job.posted)
        elif job is not None:
            job.cancelled.set()  # the worker posts no more and returns once its posted writes ended
            draining = job.future
        else:
            draining = None
        for done in [h for h, f in self._settling.items() if f.done()]:  # forgotten if never asked
            del self._settling[done]
        if draining is not None and not draining.done():
            self._settling[handle] = draining

    def settled(self, handle: int) -> bool:
        draining = self._settling.get(handle)
        if draining is None or draining.done():
            self._settling.pop(handle, None)
            return True
        return False

    def pending(self) -> int:
        return len(self._jobs)

    def disconnect(self, peer: str) -> None:
        self._peers.pop(peer, None)
        for handle, job in list(self._jobs.items()):
            if job.peer == peer:
                self.abort(handle)
        # A receive engine not fenced: its driver was not chosen, or the handshake failed
        # before the peer could use it. Nothing of the peer was announced into it.
        self._receivers.drop(peer)

    def close(self) -> None:
        if self._engine is None:
            return
        for handle in list(self._jobs):
            self.abort(handle)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        # The engine must outlive every batch it posted; wait for them, but not forever.
        _, running = wait(list(self._running), timeout=CLOSE_GRACE_S)
        if running:
            log.warning(
                "%s: %d writes still in flight after %.0f s; leaving the engine to the process",
                self.name,
                len(running),
                CLOSE_GRACE_S,
            )
        else:
            self._engine.close()
        self._receivers.close()
        self._engine = None
        self._peers.clear()


def _info(engine: Engine) -> bytes:
    """The connection info peers write with: the engine's session and protocol."""
    info = msgpack.packb({"session": engine.session, "protocol": engine.protocol})
    assert isinstance(info, bytes)
    return info
