"""The staged pipeline's wire stage: each gathered chunk written into the peer's ring, the
writes watched until they complete, then each chunk's notice to the receiver.

Owns :class:`WireStage`, the sender's base part of ``StagingPipeline`` (see ``ring_state`` for
why the parts are classes of one object): starting a chunk's write (``_post``); the wire thread
(``_wire_loop``, ``_wire_step``) and how it paces its checks (``_WirePace``, ``WIRE_POLL_*``,
``WIRE_SPIN_*``); what follows a completed write (``_written``: the notice, the outbound slot
back, the batch's count), a failed one (``_wire_failed``) or one abandoned at close
(``_abandon``); and the recovery of a sender stage that raised (``_stage_failed``, for the
gather stage too).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from kvtransport.spi.errors import DriverError, EngineError, KVTransportError
from kvtransport.staging.notices import encode_chunk, encode_release
from kvtransport.staging.ring_state import RingState, _InFlight, _Job, _Outbound, _Work, log

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


@dataclass
class _WirePace:
    """How the wire stage waits between checks of writes in flight (see ``WIRE_POLL_S``)."""

    nap: float = WIRE_POLL_MIN_S
    spin_until: float = 0.0


class WireStage(RingState):
    """The wire stage of the sender (see the module's docstring)."""

    def _post(self, out: _Outbound, job: _Job, local: int, remote: int) -> Any:
        """Start writing outbound slot ``local`` into the peer's slot ``remote``; its token."""
        return out.link.post(self._out_ptr(local), out.remote_ring + remote * out.remote_slot_bytes, job.chunk.nbytes)

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


def _as_error(name: str, exc: BaseException) -> KVTransportError:
    return exc if isinstance(exc, KVTransportError) else EngineError(f"{name}: {type(exc).__name__}: {exc}")
