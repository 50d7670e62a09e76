"""The staged pipeline: KV pages through a bounded host ring, pipelined, with credit flow control.

This module owns :class:`StagingPipeline`, the one object a staged driver holds: its
construction and its three stage threads (started here, stopped and joined by ``close``), the
peers' connections (``connect``, ``disconnect``) and the routing of each notice from a peer
(``on_notice``). The rest of its API and the work come from its parts, classes it derives from
(``ring_state`` says why they are not helper objects):

- :mod:`.ring_state`: the records, the one lock, the ring's slot accounting (``describe``,
  ``usage``, ``pending``);
- :mod:`.sending`: ``submit``, ``poll``, ``abort``, ``settled``, credits, the gather stage;
- :mod:`.wire_stage`: the wire stage (writes, their notices, failures, abandoning at close);
- :mod:`.receiving`: ``lend_ahead``, ``inbound_idle``, grants and revokes, chunk checks, the
  scatter stage.

The limits and types those modules define (``RingUsage``, ``Guard``, ``LEND_MAX_SLOTS``,
``INLINE_*``, ``WIRE_*``, ``DEFAULT_GRANT_TIMEOUT_S``, ``_within_slot``) are importable from
here too.

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

import threading
import time
from collections.abc import Callable
from typing import Any

from kvtransport.spi.errors import ConfigError, DriverError, PeerLost, ProtocolError
from kvtransport.spi.memory import RegionSet
from kvtransport.staging.config import ENV_CHUNK_BYTES, MAX_SLOTS, RingConfig
from kvtransport.staging.copy import CopyEngine, WireLink
from kvtransport.staging.notices import Grant, Lend, Revoke, decode_notice
from kvtransport.staging.receiving import ReceivingSide
from kvtransport.staging.receiving import _within_slot as _within_slot
from kvtransport.staging.ring_state import DEFAULT_GRANT_TIMEOUT_S as DEFAULT_GRANT_TIMEOUT_S
from kvtransport.staging.ring_state import INLINE_CHUNK_MAX_BYTES as INLINE_CHUNK_MAX_BYTES
from kvtransport.staging.ring_state import INLINE_CHUNK_MAX_PIECES as INLINE_CHUNK_MAX_PIECES
from kvtransport.staging.ring_state import LEND_MAX_SLOTS as LEND_MAX_SLOTS
from kvtransport.staging.ring_state import Guard as Guard
from kvtransport.staging.ring_state import RingUsage as RingUsage
from kvtransport.staging.ring_state import _Inbound, _Outbound, log
from kvtransport.staging.sending import INLINE_FINISH_S as INLINE_FINISH_S
from kvtransport.staging.sending import SendingSide
from kvtransport.staging.wire_stage import WIRE_POLL_MIN_S as WIRE_POLL_MIN_S
from kvtransport.staging.wire_stage import WIRE_POLL_S as WIRE_POLL_S
from kvtransport.staging.wire_stage import WIRE_SPIN_MAX_BYTES as WIRE_SPIN_MAX_BYTES
from kvtransport.staging.wire_stage import WIRE_SPIN_S as WIRE_SPIN_S


class StagingPipeline(SendingSide, ReceivingSide):
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
        super().__init__(
            name,
            ring_ptr,
            config,
            copy,
            notify,
            local_regions,
            scatter_delay,
            grant_timeout=grant_timeout,
            guard=guard,
            completed=completed,
            progress=progress,
        )
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

    def disconnect(self, peer: str, *, hold_slots: bool = False) -> None:
        """Forget ``peer``: its batches fail, the inbound slots it held come back (or, with
        ``hold_slots``, stay out of use until :meth:`release_held`: its engine may still write
        into them)."""
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
                # Slots it held come back now (revoked ones too), unless the driver could not
                # fence the peer's writes into them; slots still being scattered come back when
                # done (their chunk was written and announced: the peer no longer holds them).
                if hold_slots:
                    self._held_in.setdefault(peer, []).extend([*inbound.granted, *inbound.revoked])
                    self._cap_held()
                else:
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

    def _cap_held(self) -> None:
        """Lock held. Slots kept from departed peers take at most a quarter of the ring: past it
        the oldest peer's go back (logged), so that peers that come and go on this host cannot
        starve the ring (a residual risk for that peer's late writes, said in the log)."""
        cap = max(1, self.config.slots // 4)
        while sum(map(len, self._held_in.values())) > cap and len(self._held_in) > 0:
            peer, slots = next(iter(self._held_in.items()))
            del self._held_in[peer]
            self._free_in.extend(slots)
            log.warning(
                "%s: %d ring slots of departed peer %s go back unfenced: departed peers hold a quarter of the ring",
                self.name,
                len(slots),
                peer,
            )

    def release_held(self, peer: str) -> None:
        """The slots kept from departed ``peer`` (``disconnect(hold_slots=True)``) are safe now."""
        with self._lock:
            self._free_in.extend(self._held_in.pop(peer, []))
            self._wake_all()
        self._grant()

    def scatter_idle(self, peer: str) -> bool:
        """No chunk of ``peer`` is being copied into KV pages now (its errors aside)."""
        with self._lock:
            inbound = self._in.get(peer)
            return inbound is None or not inbound.busy

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

    # -- notices ------------------------------------------------------------------------------

    def on_notice(self, peer: str, payload: bytes) -> None:
        """A notice from ``peer``: a grant, lend or revoke is for this side's sending (its
        credits), a want, release or chunk for its receiving."""
        notice = decode_notice(payload, MAX_SLOTS)
        if isinstance(notice, Grant):
            self._take_granted(peer, notice)
            return
        if isinstance(notice, Lend):
            self._take_lent(peer, notice)
            return
        if isinstance(notice, Revoke):
            self._give_back(peer, notice)
            return
        self._receive_notice(peer, notice)
