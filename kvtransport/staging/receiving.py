"""The staged pipeline's receiver: inbound slots granted and lent to peers, their chunks checked
and copied into KV, and slots taken back from peers that sit on them.

Owns :class:`ReceivingSide`, a part of ``StagingPipeline`` (see ``ring_state`` for why the
parts are classes of one object): a peer's wants, releases and chunk notices
(``_receive_notice``); ``lend_ahead`` and ``inbound_idle``; each chunk's checks
(``_accept_chunk``, ``_within_slot``, the guard) and its copy in, on the thread that read its
notice or on the scatter thread (``_scatter_loop``, ``_scatter_step``, ``_scatter_one``,
``_scatter_failed``); handing free inbound slots to waiting peers, one at a time round robin
(``_grant``); and taking back slots held unused while another peer waits (``_reclaim_stale``).
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtransport.spi.errors import EngineError, KVTransportError, ProtocolError
from kvtransport.spi.inbound import FEW_PIECES
from kvtransport.spi.plan import check_runs_within
from kvtransport.staging.chunks import Chunk
from kvtransport.staging.copy import Pieces, as_list, as_u64, shifted
from kvtransport.staging.notices import (
    MAX_HOLD_MS,
    ChunkNotice,
    Release,
    Want,
    encode_grant,
    encode_lend,
    encode_revoke,
)
from kvtransport.staging.ring_state import LEND_MAX_SLOTS, RingState, _Inbound, log


@dataclass
class _ScatterUnit:
    """What one unit of the scatter stage holds: its peer, and the slot of the chunk it is
    copying in until the slot is freed (``None`` once it is)."""

    peer: str = ""
    held: tuple[_Inbound, int] | None = None


class ReceivingSide(RingState):
    """The receiver's calls, grants and scatter stage (see the module's docstring)."""

    def _receive_notice(self, peer: str, notice: Want | Release | ChunkNotice) -> None:
        """A notice from ``peer`` for this side's receiving: a want, a release or a chunk."""
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
