"""The staged pipeline's sender: the driver's sending calls, the credits the receiver hands
out, and the gather stage.

Owns :class:`SendingSide`, a part of ``StagingPipeline`` built on the wire stage it hands
gathered chunks to (see ``ring_state`` for why the parts are classes of one object):
``submit``, ``poll``, ``abort`` and ``settled``; the credits a receiver grants, lends and
revokes (``_take_granted``, ``_take_lent``, ``_give_back``); the gather thread
(``_gather_loop``, ``_gather_step``, ``_next_gather``), which copies each chunk that has a
credit and a free outbound slot into that slot; and a small request gathered and posted on the
thread that submits it (``_gather_and_post``, ``INLINE_FINISH_S``).
"""

from __future__ import annotations

import os
import time

from kvtransport.spi.errors import DriverError, EngineError, PeerLost, ProtocolError
from kvtransport.spi.plan import Runs
from kvtransport.staging.chunks import chunk_runs
from kvtransport.staging.copy import shifted
from kvtransport.staging.notices import Grant, Lend, Revoke, encode_chunk, encode_release, encode_want
from kvtransport.staging.ring_state import LEND_MAX_SLOTS, _Batch, _Job, _Outbound, _Work, log
from kvtransport.staging.wire_stage import WireStage

#: How long the thread that gathered and posted a small chunk itself (see ``submit``) checks its
#: write back to back before the wire stage takes it over. One that finishes within it has its
#: notice (and, with ordered notices, its transfer's "done") sent from that thread: the wire
#: thread is not woken at all, a wake-up that costs 0.05-0.3 ms on a small virtual machine.
INLINE_FINISH_S = 0.0005


class SendingSide(WireStage):
    """The sender's calls, credits and gather stage (see the module's docstring)."""

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

    # -- credits from the receiver ----------------------------------------------------------

    def _take_granted(self, peer: str, notice: Grant) -> None:
        """Credits the receiver granted, as this side asked (``want``)."""
        with self._lock:
            out = self._out.get(peer)
            if out is not None:
                # Only as many credits as were asked for: a peer cannot inflate them.
                take = [s for s in notice.slots if s < out.remote_slots][: out.asked]
                out.asked -= len(take)
                out.credits.extend(take)
                self._gather_cv.notify()

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
