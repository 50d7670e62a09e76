"""What every staged driver shares: the pipeline's half of the driver SPI."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from kvtransport.spi.driver import FENCE_WAIT_S, DriverContext, KVTransport
from kvtransport.spi.errors import DriverError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs
from kvtransport.staging.config import OPT_SCATTER_DELAY, RingConfig
from kvtransport.staging.copy import CopyEngine, MemcpyCopyEngine
from kvtransport.staging.pipeline import StagingPipeline

log = logging.getLogger(__name__)

#: What stage threads that did not stop at close may still use (see :func:`abandon`).
_ABANDONED: list[Any] = []


def abandon(*things: Any) -> None:
    """Keep ``things`` (a ring, an engine, the pipeline) referenced for the rest of the
    process: a stage thread that did not stop when its pipeline closed (stuck inside an engine
    or a copy) may still touch them when it wakes, so they are deliberately leaked instead of
    freed under it. Rare, and logged by the caller."""
    _ABANDONED.append(things)


class StagedTransport(KVTransport):
    """Base of a staged driver: the pipeline's half of the SPI. A subclass allocates a ring its
    engine can write, calls :meth:`start_pipeline`, and connects peers with a
    :class:`~kvtransport.staging.WireLink`; ``submit``, ``poll``, ``abort``, ``pending``,
    ``on_notice``, ``inbound_idle`` and ``expecting`` are the pipeline's. Every inbound piece is checked against
    the pages the peer's transfers announced (``context.check_inbound``) before it is written."""

    signals_completion: ClassVar[bool] = True
    #: Posting (or queueing for the pipeline) never blocks, and the engine takes calls from any thread.
    thread_agnostic: ClassVar[bool] = True
    _pipeline: StagingPipeline | None = None

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        #: Departed peers not fenced yet: the ring slots they held stay out of use.
        self._unfenced: set[str] = set()

    @property
    def pipeline(self) -> StagingPipeline:
        if self._pipeline is None:
            raise DriverError(f"{self.name}: used before open()")
        return self._pipeline

    def gauges(self) -> Mapping[str, float]:
        """The ring's slots (per direction) and those in use: being filled or written
        (outbound), granted to peers, holding a peer's chunk (busy); batches in flight."""
        pipeline = self._pipeline
        if pipeline is None:
            return {}
        usage = pipeline.usage()
        return {
            "ring_slots": float(pipeline.config.slots),
            "ring_outbound": float(usage.outbound),
            "ring_granted": float(usage.granted),
            "ring_busy": float(usage.busy),
            "batches": float(pipeline.pending()),
        }

    def start_pipeline(self, ring_ptr: int, config: RingConfig, regions: RegionSet) -> StagingPipeline:
        """The pipeline over ``ring_ptr``, with the copy engine ``regions`` need (CUDA streams
        for device KV, the ring page-locked; memcpy for host KV)."""
        copy: CopyEngine
        if regions.kv_kind.device is None:
            copy = MemcpyCopyEngine()
        else:
            from kvtransport.staging.cuda_copy import CudaCopyEngine

            cuda = CudaCopyEngine(regions.kv_kind.device)
            try:
                cuda.pin(ring_ptr, config.ring_bytes)
            except BaseException:
                cuda.close()
                raise
            copy = cuda
        try:
            delay = float(self.context.options.get(OPT_SCATTER_DELAY, "0") or 0)
            context = self.context
            self._pipeline = StagingPipeline(
                self.name,
                ring_ptr,
                config,
                copy,
                context.send_notice,
                regions,
                scatter_delay=delay,
                guard=context.check_inbound,
                completed=context.completed,
                progress=context.inbound_progress,
            )
        except BaseException:
            copy.close()
            raise
        return self._pipeline

    def stop_pipeline(self) -> bool:
        """Close the pipeline. ``True`` once none of its stage threads can touch the ring, the
        copy engine or the host engine any more: the caller may free them. ``False`` when one
        is still running: the pipeline is kept referenced (:func:`abandon`), and the caller
        must leak its ring and engine too, with a warning, never free them."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is None:
            return True
        if pipeline.close():
            return True
        abandon(pipeline)
        return False

    def fence_wire(self, peer: str) -> bool:
        """Whether ``peer``'s engine can no longer write into this endpoint's ring (its receive
        side cut off: see ``KVTransport.fence``). A subclass whose engine gives each peer a
        receive side of its own answers for it; by default nothing can be promised."""
        return False

    def fence(self, peer: str) -> bool:
        """The peer's chunks are refused once its connection ended (``check_inbound``); its
        chunk being copied in now finishes; its writes into the ring are the engine's to fence
        (:meth:`fence_wire`). Until they are, the ring slots it held go to nobody else."""
        wire = self.fence_wire(peer)
        pipeline = self._pipeline
        if pipeline is None:
            return wire
        if not wire:
            self._unfenced.add(peer)
            return False
        deadline = time.monotonic() + FENCE_WAIT_S
        while not pipeline.scatter_idle(peer):
            if time.monotonic() > deadline:
                self._unfenced.add(peer)
                return False
            time.sleep(0.001)
        if peer in self._unfenced:
            self._unfenced.discard(peer)
            pipeline.release_held(peer)
        return True

    def disconnect(self, peer: str) -> None:
        if self._pipeline is not None:
            self._pipeline.disconnect(peer, hold_slots=peer in self._unfenced)

    def submit(self, peer: str, runs: Runs) -> int:
        return self.pipeline.submit(peer, runs)

    def poll(self, handle: int) -> bool:
        return self.pipeline.poll(handle)

    def abort(self, handle: int) -> None:
        if self._pipeline is not None:
            self._pipeline.abort(handle)

    def settled(self, handle: int) -> bool:
        return self._pipeline.settled(handle) if self._pipeline is not None else True

    def pending(self) -> int:
        return self._pipeline.pending() if self._pipeline is not None else 0

    def on_notice(self, peer: str, payload: bytes) -> None:
        self.pipeline.on_notice(peer, payload)

    def inbound_idle(self, peer: str) -> bool:
        return self.pipeline.inbound_idle(peer)

    def expecting(self, peer: str, nbytes: int) -> None:
        if self._pipeline is not None:
            self._pipeline.lend_ahead(peer, nbytes)

    def ring_usage(self) -> dict[str, int]:
        """Slots in use (outbound, granted, busy), the inbound peak and the stage threads, for
        tests and diagnosis."""
        usage = self.pipeline.usage()
        return {
            "outbound": usage.outbound,
            "granted": usage.granted,
            "busy": usage.busy,
            "slots": self.pipeline.config.slots,
            "peak_inbound": self.pipeline.peak_inbound,
            "threads": self.pipeline.threads,
        }
