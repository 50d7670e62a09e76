"""The staged path: KV pages through a bounded host ring, pipelined, with credit flow control.

Any driver that can write host memory to a peer gets a staged variant from this module: it
provides the ring (host memory its engine registered), a :class:`WireLink` that starts
writing a chunk to the peer's ring and tells when it is there, and the endpoint's
``send_notice``. The pipeline does the rest.

Sender, per chunk (at most ``chunk_bytes`` of the request's runs):

1. take a credit (a slot of the receiver's inbound ring the receiver granted to us) and a free
   slot of our outbound ring;
2. gather the chunk's pieces from KV pages into the outbound slot (copy engine: device to
   host on a CUDA stream, or memcpy);
3. write the slot into the granted remote slot (the host driver); free the outbound slot;
4. notice the receiver: "slot s holds these pieces for these pages".

Receiver, per notice: check every piece lies inside its registered regions, scatter the slot
into the pages (host to device), free the slot and grant it again to whichever peer is waiting.

Stages run on their own threads, so the gather of chunk k+1 overlaps the wire write of chunk k
and the peer's scatter of chunk k-1. The receiver hands out credits, never more than its
inbound slots: a slow receiver throttles the sender and is never overrun, and a transfer
larger than the ring streams through it. The ring is split in two halves, outbound and
inbound, so an endpoint that both sends and receives cannot deadlock on its own slots.
Aborts, disconnects and close return every slot; :meth:`StagingPipeline.usage` shows it.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import numpy as np
import numpy.typing as npt

from .driver import KVTransport
from .errors import ConfigError, DriverError, EngineError, KVTransportError, PeerLost, ProtocolError, TransferAborted
from .memory import RegionSet
from .plan import Runs, check_runs_within

log = logging.getLogger(__name__)

ENV_RING_BYTES = "KVTRANSPORT_STAGING_RING_BYTES"
ENV_CHUNK_BYTES = "KVTRANSPORT_STAGING_CHUNK_BYTES"
OPT_RING = "staging.ring_bytes"
OPT_CHUNK = "staging.chunk_bytes"
#: Test hook (driver option): seconds the receiver waits before each scatter, a slow receiver.
OPT_SCATTER_DELAY = "staging.scatter_delay"
DEFAULT_RING_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 8 << 20
#: How long the wire stage sleeps between completion checks when nothing else is to be done.
#: Polling with a sleep, not an engine's blocking wait: Mooncake's waits spin a core, and on a
#: small host that core is the one the copies need.
WIRE_POLL_S = 0.0002

U64 = npt.NDArray[np.uint64]


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingConfig:
    """Ring size and chunk size; the ring holds ``slots`` chunks each way."""

    ring_bytes: int = DEFAULT_RING_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096 or self.ring_bytes < 2 * self.chunk_bytes:
            raise ConfigError(
                f"staging ring of {self.ring_bytes} bytes with {self.chunk_bytes}-byte chunks: chunks must be at "
                f"least 4 KiB and the ring must hold at least one chunk each way ({ENV_RING_BYTES}, {ENV_CHUNK_BYTES})"
            )

    @property
    def slots(self) -> int:
        """Slots per direction."""
        return self.ring_bytes // self.chunk_bytes // 2

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, options: Mapping[str, str] | None = None) -> RingConfig:
        """From ``KVTRANSPORT_STAGING_*``; an endpoint's ``driver_options`` (``staging.ring_bytes``,
        ``staging.chunk_bytes``) take precedence."""
        env = dict(os.environ) if env is None else dict(env)
        opts = dict(options or {})
        env.update({n: opts[k] for k, n in ((OPT_RING, ENV_RING_BYTES), (OPT_CHUNK, ENV_CHUNK_BYTES)) if k in opts})

        def read(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a number of bytes") from None

        return cls(read(ENV_RING_BYTES, DEFAULT_RING_BYTES), read(ENV_CHUNK_BYTES, DEFAULT_CHUNK_BYTES))


# --- the copy-engine seam ---------------------------------------------------------------------


class CopyEngine(Protocol):
    """Copies pieces between KV memory and the host ring; ``copy`` returns when every byte is
    in place (for device copies: when the stream's work has completed)."""

    name: str

    def copy(self, dst: U64, src: U64, length: U64) -> None: ...

    def close(self) -> None: ...


class MemcpyCopyEngine:
    """Host memory to host memory with ``memmove`` (the GIL is released during each copy)."""

    name = "memcpy"

    def copy(self, dst: U64, src: U64, length: U64) -> None:
        for d, s, n in zip(dst.tolist(), src.tolist(), length.tolist(), strict=True):
            ctypes.memmove(d, s, n)

    def close(self) -> None:
        return None


# --- the wire seam -----------------------------------------------------------------------------


class WireLink(Protocol):
    """How a host driver moves one chunk to one peer: ``post`` starts writing ``length`` bytes
    from this ring to the peer's ring and returns a token; ``check`` says whether it is there
    (raises if it failed). Neither may block for the transfer."""

    def post(self, local: int, remote: int, length: int) -> Any: ...

    def check(self, token: Any) -> bool: ...


# --- chunking -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """Pieces of runs packed back to back into one ring slot: piece i goes from ``src[i]`` to
    ``dst[i]`` through the slot at ``offset[i]``."""

    src: U64
    dst: U64
    length: U64
    offset: U64

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


def chunk_runs(runs: Runs, chunk_bytes: int) -> list[Chunk]:
    """Cut ``runs`` into chunks of at most ``chunk_bytes``, splitting runs at chunk borders."""
    if not len(runs):
        return []
    length = runs.length.astype(np.uint64)
    end = np.cumsum(length, dtype=np.uint64)
    start = end - length
    total = int(end[-1])
    borders = np.arange(chunk_bytes, total, chunk_bytes, dtype=np.uint64)
    cuts = np.union1d(start, borders)  # sorted piece starts in the packed stream
    piece_end = np.append(cuts[1:], np.uint64(total))
    run_of = np.searchsorted(start, cuts, side="right") - 1
    skew = cuts - start[run_of]
    src = runs.src[run_of] + skew
    dst = runs.dst[run_of] + skew
    plen = piece_end - cuts
    which = cuts // np.uint64(chunk_bytes)
    offset = cuts - which * np.uint64(chunk_bytes)
    bounds = np.flatnonzero(np.diff(which)) + 1
    return [
        Chunk(s, d, n, o)
        for s, d, n, o in zip(
            np.split(src, bounds), np.split(dst, bounds), np.split(plen, bounds), np.split(offset, bounds), strict=True
        )
    ]


# --- the pipeline -----------------------------------------------------------------------------


@dataclass
class RingUsage:
    """Slots in use now: outbound (ours, being filled or written), granted to peers (credits
    not yet used), busy (holding a peer's chunk until its scatter completes)."""

    outbound: int
    granted: int
    busy: int

    @property
    def total(self) -> int:
        return self.outbound + self.granted + self.busy


@dataclass
class _Batch:
    peer: str
    chunks: int
    written: int = 0
    error: KVTransportError | None = None
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return self.error is not None or self.aborted or self.written == self.chunks


@dataclass
class _Job:
    batch: _Batch
    chunk: Chunk


@dataclass
class _Outbound:
    """Sending to one peer: its ring geometry, queued chunks, credits, and the two stage threads."""

    peer: str
    remote_ring: int
    remote_slot_bytes: int
    link: WireLink
    queue: collections.deque[_Job] = field(default_factory=collections.deque)
    credits: list[int] = field(default_factory=list)
    asked: int = 0  # credits requested and not yet granted
    wire: collections.deque[tuple[_Job, int, int]] = field(default_factory=collections.deque)
    closed: bool = False
    threads: list[threading.Thread] = field(default_factory=list)


@dataclass
class _Inbound:
    """Receiving from one peer: what it asked for, which slots it holds, what is being scattered."""

    wants: int = 0
    granted: set[int] = field(default_factory=set)
    busy: set[int] = field(default_factory=set)
    error: KVTransportError | None = None


class StagingPipeline:
    """One endpoint's ring and pipeline for a staged driver. All public methods are called by
    the driver from the endpoint's I/O thread; the stages run on their own threads."""

    def __init__(
        self,
        name: str,
        ring_ptr: int,
        config: RingConfig,
        copy: CopyEngine,
        notify: Callable[[str, bytes], None],
        local_regions: RegionSet,
        scatter_delay: float = 0.0,
    ) -> None:
        self.name = name
        self.scatter_delay = scatter_delay
        #: Most inbound slots ever held by peers at once (granted or busy); never above ``slots``.
        self.peak_inbound = 0
        self.ring_ptr = ring_ptr
        self.config = config
        self.copy_engine = copy
        self._notify = notify
        self._regions = local_regions
        slots = config.slots
        # Fault the ring in now, not in the middle of the first transfer.
        ctypes.memset(ring_ptr, 0, 2 * slots * config.chunk_bytes)
        self._lock = threading.Condition()
        self._free_out = list(range(slots))
        self._free_in = list(range(slots))
        self._out: dict[str, _Outbound] = {}
        self._in: dict[str, _Inbound] = {}
        self._batches: dict[int, _Batch] = {}
        self._next = 0
        self._rr: collections.deque[str] = collections.deque()
        self._scatter: collections.deque[tuple[str, int, Chunk]] = collections.deque()
        self._closed = False
        self._scatter_thread = threading.Thread(target=self._scatter_loop, name=f"{name}-scatter", daemon=True)
        self._scatter_thread.start()

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
                granted=sum(len(i.granted) for i in self._in.values()),
                busy=sum(len(i.busy) for i in self._in.values()),
            )

    # -- connections --------------------------------------------------------------------------

    def connect(self, peer: str, remote: dict[str, Any], link: WireLink) -> None:
        try:
            ring, slot_bytes, first = int(remote["ring"]), int(remote["slot_bytes"]), int(remote["inbound_first"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"{self.name}: the peer's staging ring description is malformed: {exc}") from exc
        out = _Outbound(peer, ring + first * slot_bytes, slot_bytes, link)
        if slot_bytes < self.config.chunk_bytes:
            raise ConfigError(
                f"{self.name}: the peer's ring slots hold {slot_bytes} bytes, this side's chunks are "
                f"{self.config.chunk_bytes}; set the same {ENV_CHUNK_BYTES} on both sides"
            )
        with self._lock:
            self._out[peer] = out
            self._in.setdefault(peer, _Inbound())
        for stage, target in (("gather", self._gather_loop), ("wire", self._wire_loop)):
            t = threading.Thread(target=target, args=(out,), name=f"{self.name}-{stage}-{peer[:8]}", daemon=True)
            out.threads.append(t)
            t.start()

    def disconnect(self, peer: str) -> None:
        with self._lock:
            out = self._out.pop(peer, None)
            inbound = self._in.pop(peer, None)
            if out is not None:
                out.closed = True
                for job in out.queue:
                    job.batch.error = job.batch.error or PeerLost(f"{self.name}: peer {peer} went away")
                out.queue.clear()
            for batch in self._batches.values():
                if batch.peer == peer and not batch.finished:
                    batch.error = PeerLost(f"{self.name}: peer {peer} went away")
            if inbound is not None:
                # Slots it held come back now; slots still being scattered come back when done.
                self._free_in.extend(inbound.granted)
                inbound.granted.clear()
                if inbound.busy:
                    self._in[f"(gone){peer}"] = inbound
            self._lock.notify_all()
        self._grant()

    def close(self, timeout: float = 10.0) -> None:
        """Stop every stage; returns once none can touch the ring or the engine any more (or
        after ``timeout``, logged)."""
        with self._lock:
            outs = list(self._out.values())
        for out in outs:
            self.disconnect(out.peer)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        threads = [self._scatter_thread, *(t for out in outs for t in out.threads)]
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning("%s: stages still running after %.0f s: %s", self.name, timeout, ", ".join(alive))
        self.copy_engine.close()

    # -- sender ------------------------------------------------------------------------------

    def submit(self, peer: str, runs: Runs) -> int:
        chunks = chunk_runs(runs, self.config.chunk_bytes)
        with self._lock:
            out = self._out.get(peer)
            if out is None:
                raise PeerLost(f"{self.name}: submit to {peer!r}, which is not connected")
            self._next += 1
            batch = _Batch(peer, len(chunks))
            self._batches[self._next] = batch
            out.queue.extend(_Job(batch, c) for c in chunks)
            need = len(out.queue) - len(out.credits) - out.asked
            if need > 0:
                out.asked += need
            self._lock.notify_all()
        if need > 0:
            self._send(peer, {"op": "want", "n": need})
        return self._next

    def poll(self, handle: int) -> bool:
        with self._lock:
            batch = self._batches.get(handle)
            if batch is None:
                raise KVTransportError(f"{self.name}: unknown handle {handle}")
            if not batch.finished:
                return False
            del self._batches[handle]
        if batch.aborted:
            raise TransferAborted(f"{self.name}: batch {handle} was aborted")
        if batch.error is not None:
            raise batch.error
        return True

    def abort(self, handle: int) -> None:
        with self._lock:
            batch = self._batches.get(handle)
            if batch is not None and not batch.finished:
                batch.aborted = True
            self._lock.notify_all()

    def _gather_loop(self, out: _Outbound) -> None:
        while True:
            with self._lock:
                while True:
                    if out.closed or self._closed:
                        return
                    while out.queue and out.queue[0].batch.finished:
                        out.queue.popleft()  # aborted or failed: skip, keep the credit
                    if out.queue and out.credits and self._free_out:
                        break
                    self._release_surplus(out)
                    self._lock.wait(0.5)
                job = out.queue.popleft()
                remote = out.credits.pop()
                local = self._free_out.pop()
            try:
                c = job.chunk
                self.copy_engine.copy(np.uint64(self._out_ptr(local)) + c.offset, c.src, c.length)
            except Exception as exc:  # noqa: BLE001 - the batch fails, the slots come back
                with self._lock:
                    job.batch.error = EngineError(f"{self.name}: gathering a chunk failed: {exc}")
                    self._free_out.append(local)
                    out.credits.append(remote)
                    self._lock.notify_all()
                continue
            with self._lock:
                out.wire.append((job, local, remote))
                self._lock.notify_all()

    def _wire_loop(self, out: _Outbound) -> None:
        inflight: list[tuple[Any, _Job, int, int]] = []
        while True:
            with self._lock:
                while not out.wire and not inflight:
                    if out.closed or self._closed:
                        return
                    self._lock.wait(0.5)
                ready = list(out.wire)
                out.wire.clear()
            failed: list[tuple[_Job, int, int, KVTransportError]] = []
            for job, local, remote in ready:
                try:
                    token = out.link.post(
                        self._out_ptr(local), out.remote_ring + remote * out.remote_slot_bytes, job.chunk.nbytes
                    )
                except Exception as exc:  # noqa: BLE001
                    failed.append((job, local, remote, self._as_error(exc)))
                else:
                    inflight.append((token, job, local, remote))
            done: list[tuple[_Job, int, int]] = []
            still: list[tuple[Any, _Job, int, int]] = []
            for token, job, local, remote in inflight:
                try:
                    finished = out.link.check(token)
                except Exception as exc:  # noqa: BLE001
                    failed.append((job, local, remote, self._as_error(exc)))
                    continue
                if finished:
                    done.append((job, local, remote))
                else:
                    still.append((token, job, local, remote))
            inflight = still
            for job, _, remote in done:
                c = job.chunk
                # Queued before the batch counts the chunk written, so the endpoint sends it
                # before the "done" that completes the transfer.
                self._send(
                    out.peer,
                    {
                        "op": "chunk",
                        "slot": remote,
                        "dst": c.dst.tobytes(),
                        "len": c.length.tobytes(),
                        "off": c.offset.tobytes(),
                    },
                )
            if done or failed:
                with self._lock:
                    for job, local, _ in done:
                        self._free_out.append(local)
                        job.batch.written += 1
                    for job, local, remote, error in failed:
                        job.batch.error = job.batch.error or error
                        self._free_out.append(local)
                        out.credits.append(remote)  # nothing usable landed there: reuse it
                    self._lock.notify_all()
            elif not ready:
                time.sleep(WIRE_POLL_S)

    def _as_error(self, exc: BaseException) -> KVTransportError:
        return exc if isinstance(exc, KVTransportError) else EngineError(f"{self.name}: {type(exc).__name__}: {exc}")

    def _release_surplus(self, out: _Outbound) -> None:
        """Give back credits nothing queued will use, so other senders can have the slots.
        Called with the lock held."""
        if out.credits and not out.queue:
            slots, out.credits = out.credits, []
            self._send(out.peer, {"op": "release", "slots": slots})

    # -- receiver ------------------------------------------------------------------------------

    def on_notice(self, peer: str, payload: bytes) -> None:
        try:
            msg = msgpack.unpackb(payload)
            op = msg["op"]
        except Exception as exc:
            raise ProtocolError(f"{self.name}: undecodable staging notice: {exc}") from exc
        if op == "grant":
            with self._lock:
                out = self._out.get(peer)
                if out is not None:
                    slots = [int(s) for s in msg["slots"]]
                    out.asked = max(0, out.asked - len(slots))
                    out.credits.extend(slots)
                    self._lock.notify_all()
            return
        inbound = self._in.get(peer)
        if inbound is None:
            raise ProtocolError(f"{self.name}: staging notice from unknown peer {peer}")
        if op == "want":
            with self._lock:
                inbound.wants += max(0, int(msg["n"]))
            self._grant()
        elif op == "release":
            with self._lock:
                for s in msg["slots"]:
                    if s in inbound.granted:
                        inbound.granted.discard(s)
                        self._free_in.append(s)
            self._grant()
        elif op == "chunk":
            self._accept_chunk(peer, inbound, msg)
        else:
            raise ProtocolError(f"{self.name}: unknown staging notice {op!r}")

    def _accept_chunk(self, peer: str, inbound: _Inbound, msg: dict[str, Any]) -> None:
        slot = msg.get("slot")
        try:
            if not isinstance(slot, int) or slot not in inbound.granted:
                raise ProtocolError(f"chunk in slot {slot!r}, which was not granted to this peer")
            dst = np.frombuffer(msg["dst"], dtype=np.uint64)
            length = np.frombuffer(msg["len"], dtype=np.uint64)
            offset = np.frombuffer(msg["off"], dtype=np.uint64)
            if not (dst.size == length.size == offset.size) or dst.size == 0:
                raise ProtocolError("piece lists of different lengths")
            if np.any(offset + length > np.uint64(self.config.chunk_bytes)) or np.any(offset + length < offset):
                raise ProtocolError("a piece reaches past its ring slot")
            check_runs_within(dst, length, self._regions.all(), "staged chunk destination")
        except (ProtocolError, KVTransportError, KeyError, TypeError, ValueError) as exc:
            error = ProtocolError(f"{self.name}: bad chunk from {peer}: {exc}; nothing of it was written")
            with self._lock:
                inbound.error = error
                if isinstance(slot, int) and slot in inbound.granted:
                    inbound.granted.discard(slot)
                    self._free_in.append(slot)
            self._grant()
            return
        with self._lock:
            inbound.granted.discard(slot)
            inbound.busy.add(slot)
            src = np.uint64(self._in_ptr(slot)) + offset
            self._scatter.append((peer, slot, Chunk(src, dst, length, offset)))
            self._lock.notify_all()

    def inbound_idle(self, peer: str) -> bool:
        with self._lock:
            inbound = self._in.get(peer)
            if inbound is None:
                return True
            if inbound.error is not None:
                error, inbound.error = inbound.error, None
                raise error
            return not inbound.busy

    def _scatter_loop(self) -> None:
        while True:
            with self._lock:
                while not self._scatter:
                    if self._closed:
                        return
                    self._lock.wait(0.5)
                peer, slot, chunk = self._scatter.popleft()
            if self.scatter_delay:
                time.sleep(self.scatter_delay)
            error: KVTransportError | None = None
            try:
                self.copy_engine.copy(chunk.dst, chunk.src, chunk.length)
            except Exception as exc:  # noqa: BLE001
                error = EngineError(f"{self.name}: scattering a chunk into KV failed: {exc}")
            with self._lock:
                inbound = self._in.get(peer) or self._in.get(f"(gone){peer}")
                if inbound is not None:
                    inbound.busy.discard(slot)
                    if error is not None:
                        inbound.error = error
                    if not inbound.busy and f"(gone){peer}" in self._in:
                        del self._in[f"(gone){peer}"]
                self._free_in.append(slot)
                self._lock.notify_all()
            self._grant()

    def _grant(self) -> None:
        """Hand free inbound slots to waiting peers, one at a time round robin."""
        grants: dict[str, list[int]] = {}
        with self._lock:
            for peer in self._in:
                if peer not in self._rr and not peer.startswith("(gone)"):
                    self._rr.append(peer)
            spins = 0
            while self._free_in and self._rr and spins < len(self._rr):
                peer = self._rr[0]
                self._rr.rotate(-1)
                inbound = self._in.get(peer)
                if inbound is None:
                    self._rr.remove(peer)
                    continue
                if inbound.wants <= 0:
                    spins += 1
                    continue
                spins = 0
                slot = self._free_in.pop()
                inbound.wants -= 1
                inbound.granted.add(slot)
                self.peak_inbound = max(self.peak_inbound, self.config.slots - len(self._free_in))
                grants.setdefault(peer, []).append(slot)
        for peer, slots in grants.items():
            self._send(peer, {"op": "grant", "slots": slots})

    def _send(self, peer: str, msg: dict[str, Any]) -> None:
        data = msgpack.packb(msg)
        assert isinstance(data, bytes)
        try:
            self._notify(peer, data)
        except Exception as exc:  # noqa: BLE001 - the peer is going; disconnect cleans up
            log.debug("%s: notice to %s not sent: %s", self.name, peer, exc)


# --- what every staged driver shares ---------------------------------------------------------


class StagedTransport(KVTransport):
    """Base of a staged driver: the pipeline's half of the SPI. A subclass allocates a ring its
    engine can write, calls :meth:`start_pipeline`, and connects peers with a :class:`WireLink`;
    ``submit``, ``poll``, ``abort``, ``on_notice`` and ``inbound_idle`` are the pipeline's."""

    _pipeline: StagingPipeline | None = None

    @property
    def pipeline(self) -> StagingPipeline:
        if self._pipeline is None:
            raise DriverError(f"{self.name}: used before open()")
        return self._pipeline

    def start_pipeline(self, ring_ptr: int, config: RingConfig, regions: RegionSet) -> StagingPipeline:
        """The pipeline over ``ring_ptr``, with the copy engine ``regions`` need (CUDA streams
        for device KV, the ring page-locked; memcpy for host KV)."""
        copy: CopyEngine
        if regions.kv_kind.device is None:
            copy = MemcpyCopyEngine()
        else:
            from .cuda_copy import CudaCopyEngine

            cuda = CudaCopyEngine(regions.kv_kind.device)
            cuda.pin(ring_ptr, config.ring_bytes)
            copy = cuda
        delay = float(self.context.options.get(OPT_SCATTER_DELAY, "0") or 0)
        self._pipeline = StagingPipeline(
            self.name, ring_ptr, config, copy, self.context.send_notice, regions, scatter_delay=delay
        )
        return self._pipeline

    def stop_pipeline(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def disconnect(self, peer: str) -> None:
        if self._pipeline is not None:
            self._pipeline.disconnect(peer)

    def submit(self, peer: str, runs: Runs) -> int:
        return self.pipeline.submit(peer, runs)

    def poll(self, handle: int) -> bool:
        return self.pipeline.poll(handle)

    def abort(self, handle: int) -> None:
        self.pipeline.abort(handle)

    def on_notice(self, peer: str, payload: bytes) -> None:
        self.pipeline.on_notice(peer, payload)

    def inbound_idle(self, peer: str) -> bool:
        return self.pipeline.inbound_idle(peer)

    def ring_usage(self) -> dict[str, int]:
        """Slots in use (outbound, granted, busy) and the inbound peak, for tests and diagnosis."""
        usage = self.pipeline.usage()
        return {
            "outbound": usage.outbound,
            "granted": usage.granted,
            "busy": usage.busy,
            "slots": self.pipeline.config.slots,
            "peak_inbound": self.pipeline.peak_inbound,
        }
