"""``mooncake-staged``: KV through a bounded host staging ring, no GPUDirect RDMA needed.

The ring comes from Mooncake's ``allocate_managed_buffer`` (registered with the engine by
Mooncake itself); the pipeline, the credits and the copies are the core's
(:mod:`kvtransport.staging`). Device KV is copied with CUDA streams; host KV with memcpy, which
is how the whole pipeline runs on CPU-only machines. For host KV the offer ranks below
``mooncake-gdr`` (staging only adds two copies there): it is chosen only when forced.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar

import msgpack

from kvtransport.spi.driver import (
    DRIVER_API_VERSION,
    FENCE_WAIT_S,
    Capabilities,
    DriverContext,
    DriverStatus,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.spi.errors import DriverError, EngineError, KVTransportError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.probe import probe_host
from kvtransport.staging import ENV_CHUNK_BYTES, ENV_RING_BYTES, RingConfig, StagedTransport
from kvtransport.staging.transport import abandon

from .base import protocol_mismatch
from .engine import Engine, Receivers
from .engine_probe import ENV_VARS, cuda_note, probe_engine
from .gdr import RDMA_GBPS, TCP_GBPS

log = logging.getLogger(__name__)

#: Nominal pinned device<->host copy bandwidth of a PCIe 4.0 x16 link.
PCIE_GBPS = 20.0
#: Share of the slower stage the pipeline keeps (copy-out, wire, copy-in overlap imperfectly).
PIPELINE_EFFICIENCY = 0.8


class MooncakeStaged(StagedTransport):
    name: ClassVar[str] = "mooncake-staged"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"host", "cuda"}), writes=frozenset({"host", "cuda"}), two_sided=True, gathers=True
    )
    env_vars: ClassVar[tuple[str, ...]] = (*ENV_VARS, ENV_RING_BYTES, ENV_CHUNK_BYTES)
    raw_engine: ClassVar[str] = "kvtransport_mooncake.raw:RawMooncake"
    #: Each peer writes into the ring through an engine of its own, so ``fence`` can cut it off.
    receives_per_peer: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> DriverStatus:
        facts = probe_engine()
        if not facts.status.available:
            return facts.status
        host = probe_host()
        note = cuda_note(facts, host, need_gdr=False)
        return replace(
            facts.status,
            memory=("host",) if note else ("host", "cuda"),
            memory_notes={"cuda": note} if note else {},
            info={
                "protocol": facts.protocol,
                "protocol_note": facts.protocol_note,
                "build": facts.distribution,
            },
        )

    @classmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        if local.status is None or remote.status is None:
            return Rejection("not installed on both sides")
        mismatch = protocol_mismatch(local, remote)
        if mismatch:
            return mismatch
        protocol = local.status.info.get("protocol", "tcp")
        wire = RDMA_GBPS if protocol == "rdma" else TCP_GBPS
        if not (local.kv_memory.is_cuda or remote.kv_memory.is_cuda):
            return Offer(
                TransferPath.TCP if protocol == "tcp" else TransferPath.RDMA,
                round(wire * PIPELINE_EFFICIENCY, 2),
                f"host KV through staging rings over {protocol} (two extra copies; mooncake-gdr writes it directly)",
            )
        gbps = round(min(PCIE_GBPS, wire) * PIPELINE_EFFICIENCY, 2)
        return Offer(TransferPath.PCIE_STAGED, gbps, f"device->host ring->{protocol}->host ring->device")

    # -- data path ---------------------------------------------------------------------------

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        self._engine: Engine | None = None
        self._ring = (0, 0)
        self._sessions: dict[str, str] = {}  # peer -> its Mooncake session
        #: The engines peers write into this endpoint's ring through, one each.
        #: The CUDA device of the KV: the ring is host memory, but the NICs near that GPU are
        #: the ones near the copies into and out of it.
        self._gpu: int | None = None
        self._receivers = Receivers(
            self.name, lambda: self.context.host, lambda: ([self._ring[0]], [self._ring[1]]), lambda: self._gpu
        )

    def open(self, regions: RegionSet) -> bytes:
        if self._engine is not None:
            raise DriverError(f"{self.name}: open() called twice")
        config = RingConfig.from_env(options=self.context.options)
        self._gpu = regions.kv_kind.device
        engine = Engine(self.name, self.context.host, self._gpu)
        try:
            ring = int(engine.engine.allocate_managed_buffer(config.ring_bytes))
            if ring == 0:
                raise EngineError(
                    f"{self.name}: Mooncake could not allocate a {config.ring_bytes}-byte staging ring "
                    f"(allocate_managed_buffer returned 0); lower {ENV_RING_BYTES}"
                )
            self._ring = (ring, config.ring_bytes)
            if regions.kv_kind.is_cuda:
                from kvtransport.staging.cuda_copy import is_device_pointer

                # Mooncake allocates managed buffers with the protocol's allocator; the ring
                # must be host memory (an nvlink allocator would hand out device memory).
                if is_device_pointer(ring):
                    raise EngineError(
                        f"{self.name}: Mooncake's managed buffer is device memory under protocol "
                        f"{engine.protocol}; the staging ring must be host memory"
                    )
        except KVTransportError:
            if self._ring[0]:
                engine.engine.free_managed_buffer(*self._ring)
            engine.close()
            raise
        self._engine = engine
        try:
            self.start_pipeline(ring, config, regions)
        except BaseException:
            self.close()  # the engine and its ring go with the failed open
            raise
        return self._info(engine)

    def _info(self, engine: Engine) -> bytes:
        info = msgpack.packb({"session": engine.session, "protocol": engine.protocol, "ring": self.pipeline.describe()})
        assert isinstance(info, bytes)
        return info

    def receive_info(self, peer: str) -> bytes:
        """An engine of its own for ``peer`` to write into this endpoint's ring through, so
        that ``fence_wire`` can cut it off alone (``engine.Receivers``)."""
        if self._engine is None:
            raise DriverError(f"{self.name}: receive_info() before open()")
        return self._info(self._receivers.create(peer))

    def fence_wire(self, peer: str) -> bool:
        return self._receivers.fence(peer, FENCE_WAIT_S)

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        engine = self._engine
        if engine is None:
            raise DriverError(f"{self.name}: connect() before open()")
        try:
            doc: dict[str, Any] = msgpack.unpackb(info)
            session, protocol, ring = str(doc["session"]), str(doc["protocol"]), dict(doc["ring"])
        except Exception as exc:
            raise DriverError(
                f"{self.name}: the peer's connection info is not a staged Mooncake session: {exc}"
            ) from exc
        if protocol != engine.protocol:
            raise DriverError(f"{self.name}: the peer's engine runs {protocol}, this one {engine.protocol}")
        if session in (engine.session, *self._receivers.sessions()) or session in self._sessions.values():
            raise DriverError(
                f"{self.name}: the peer's Mooncake session {session} is this endpoint's or another peer's"
            )
        self.pipeline.connect(peer, ring, _MooncakeLink(engine, session))
        self._sessions[peer] = session

    def disconnect(self, peer: str) -> None:
        super().disconnect(peer)
        self._sessions.pop(peer, None)
        self._receivers.drop(peer)

    def close(self) -> None:
        if self._engine is None:
            return
        if not self.stop_pipeline():
            # A stage thread is still running (stuck inside Mooncake, say) and may touch the
            # ring or the engine when it wakes: freeing them under it would be a use-after-free.
            log.warning(
                "%s: a staging stage did not stop; leaking the %d-byte ring and the Mooncake engine instead of "
                "freeing them",
                self.name,
                self._ring[1],
            )
            abandon(self._engine, self._ring, self._receivers)
            self._engine = None
            return
        # Every stage stopped: nothing touches the ring or the engine after this.
        self._receivers.close()
        try:
            self._engine.engine.free_managed_buffer(*self._ring)
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown
            log.debug("%s: freeing the ring: %s", self.name, exc)
        try:
            self._engine.close()
        except Exception as exc:  # noqa: BLE001 - close never raises
            log.debug("%s: closing the engine: %s", self.name, exc)
        self._engine = None


class _MooncakeLink:
    """One chunk per Mooncake batch, completion polled (Mooncake's blocking waits spin)."""

    def __init__(self, engine: Engine, session: str) -> None:
        self.engine, self.session = engine, session

    def post(self, local: int, remote: int, length: int) -> int:
        return self.engine.post(self.session, local, remote, length)

    def check(self, token: int) -> bool:
        return self.engine.check(token)
