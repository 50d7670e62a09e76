"""``nixl-staged``: KV through the core's bounded host staging ring, with NIXL/UCX moving the
chunks between rings.

For device KV where UCX cannot move GPU memory well (a wheel without CUDA transports, no GDR),
and the proof that :mod:`kvtransport.staging` works over any host-memory engine: the ring is
private host memory registered with the NIXL agent as ``DRAM``; KV itself is never registered.
For host KV the offer ranks below ``nixl-ucx`` (staging only adds two copies there).
"""

from __future__ import annotations

import logging
import mmap
import threading
from dataclasses import replace
from typing import Any, ClassVar

import msgpack
import numpy as np

from kvtransport.spi import process_sockets
from kvtransport.spi.driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverContext,
    DriverStatus,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.spi.errors import DriverError, EngineError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.probe import probe_host
from kvtransport.staging import ENV_CHUNK_BYTES, ENV_RING_BYTES, RingConfig, StagedTransport
from kvtransport.staging.transport import abandon

from .data_path import NixlDataPath
from .engine_probe import ENV_VARS, probe_nixl
from .ucx import NO_TRANSPORT, host_wire

log = logging.getLogger(__name__)

PCIE_GBPS = 20.0
PIPELINE_EFFICIENCY = 0.8


class NixlStaged(StagedTransport, NixlDataPath):
    name: ClassVar[str] = "nixl-staged"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"host", "cuda"}), writes=frozenset({"host", "cuda"}), two_sided=True, gathers=True
    )
    env_vars: ClassVar[tuple[str, ...]] = (*ENV_VARS, ENV_RING_BYTES, ENV_CHUNK_BYTES)
    raw_engine: ClassVar[str] = "kvtransport_nixl.raw:RawNixl"
    #: Each peer writes into the ring through an agent of its own, so ``fence`` can cut it off.
    receives_per_peer: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> DriverStatus:
        facts = probe_nixl()
        if not facts.status.available:
            return facts.status
        if "DRAM_SEG" not in facts.mem_types:
            return replace(
                facts.status, available=False, reason=f"the {facts.backend} backend cannot register host memory"
            )
        host = probe_host()
        note = "" if host.cuda_devices else f"no CUDA device on this host ({host.cuda_note or 'none visible'})"
        return replace(
            facts.status,
            memory=("host",) if note else ("host", "cuda"),
            memory_notes={"cuda": note} if note else {},
            info={"module": facts.module, "backend": facts.backend},
        )

    @classmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        if local.status is None or remote.status is None:
            return Rejection("not installed on both sides")
        backends = {local.status.info.get("backend", "UCX"), remote.status.info.get("backend", "UCX")}
        if len(backends) > 1:
            return Rejection(f"NIXL backends differ between the peers: {', '.join(sorted(backends))}")
        wire = host_wire(local, remote)  # the rings are host memory, whatever the KV is
        if wire is None:
            return Rejection(NO_TRANSPORT)
        path, gbps, via = wire
        if not (local.kv_memory.is_cuda or remote.kv_memory.is_cuda):
            return Offer(
                path,
                round(gbps * PIPELINE_EFFICIENCY, 2),
                f"host KV through staging rings, {via} (two extra copies; nixl-ucx writes it directly)",
            )
        staged = round(min(PCIE_GBPS, gbps) * PIPELINE_EFFICIENCY, 2)
        return Offer(TransferPath.PCIE_STAGED, staged, f"device->host ring->{via}->host ring->device")

    # -- data path ---------------------------------------------------------------------------

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        self._ring_map: mmap.mmap | None = None
        self._ring_view: Any = None
        self._ring_reg: Any = None
        self._remote: dict[str, str] = {}
        self._remote_main: dict[str, str] = {}  # peer -> its endpoint's own agent
        # The pipeline's wire threads and the I/O thread share the agent; NIXL's default
        # thread-sync mode (without a listener thread) is "none", so calls are serialised here.
        self.agent_lock = threading.Lock()

    def open(self, regions: RegionSet) -> bytes:
        config = RingConfig.from_env(options=self.context.options)
        name = self._start_agent(regions.kv_kind.device)
        try:
            self._ring_map = mmap.mmap(-1, config.ring_bytes)
            self._ring_view = np.frombuffer(self._ring_map, dtype=np.uint8)
            ring = int(self._ring_view.ctypes.data)
            self._ring_reg = self._call(
                f"registration of the {config.ring_bytes}-byte staging ring",
                lambda: self._agent.register_memory([(ring, config.ring_bytes, 0, "")], "DRAM"),
            )
            self.start_pipeline(ring, config, regions)
            meta = self._call("metadata export", self._agent.get_agent_metadata)
        except BaseException:
            self.close()  # the agent, the ring and its registration go with the failed open
            raise
        return self._staged_info(name, meta)

    def _staged_info(self, name: str, meta: bytes) -> bytes:
        doc = {"agent": name, "meta": meta, "ring": self.pipeline.describe(), "main": self._name}
        info = msgpack.packb({**doc, **process_sockets.identity()})
        assert isinstance(info, bytes)
        return info

    def receive_info(self, peer: str) -> bytes:
        """An agent of its own for ``peer`` to write into this endpoint's ring through, so that
        ``fence_wire`` can cut it off alone (``NixlDataPath.fence_receiver``)."""
        if self._agent is None or self._ring_view is None:
            raise DriverError(f"{self.name}: receive_info() before open()")
        receiver = self._take_receiver(peer)
        return self._staged_info(receiver.name, receiver.meta)

    def _receiving_memory(self) -> tuple[list[tuple[int, int, int, str]], str]:
        """The ring: what a peer's receive agent takes its chunks into."""
        assert self._ring_view is not None
        return [(int(self._ring_view.ctypes.data), int(self._ring_view.nbytes), 0, "")], "DRAM"

    def fence_wire(self, peer: str) -> bool:
        return self.fence_receiver(peer)

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        try:
            doc = msgpack.unpackb(info)
            meta, ring = doc["meta"], dict(doc["ring"])
        except Exception as exc:
            raise DriverError(f"{self.name}: the peer's connection info is not a staged NIXL export: {exc}") from exc
        main = doc.get("main")
        main = main if isinstance(main, str) and 0 < len(main) <= 256 else ""
        self._tidy()
        with self.agent_lock:
            remote = self._add_remote(meta)
        self._note_process(peer, doc)
        self._remote[peer] = remote
        if main:
            self._remote_main[peer] = main
        self.pipeline.connect(peer, ring, _NixlLink(self, remote))

    def _known_agents(self) -> set[str]:
        return {*super()._known_agents(), *self._remote.values(), *self._remote_main.values()}

    def disconnect(self, peer: str) -> None:
        # Before the base class's disconnect, which knows connected peers by ``_peers`` (the
        # staged variant keeps its own in ``_remote``): a peer connected here connected to
        # this side's receive agent too (see ``_forget_receiver``). Not under ``agent_lock``:
        # closing an agent may take a second, and the wire threads wait on that lock.
        self._forget_receiver(peer, connected=peer in self._remote)
        super().disconnect(peer)
        self._remote_main.pop(peer, None)
        remote = self._remote.pop(peer, None)
        if remote is not None and self._agent is not None:
            with self.agent_lock:
                try:
                    self._agent.remove_remote_agent(remote)
                except Exception:  # noqa: BLE001 - the peer may be gone already
                    pass
        # (no ``_tidy`` after the removal: the base class's ``disconnect`` drove the agent
        # before it, see there)

    def _tidy(self) -> None:
        with self.agent_lock:  # the wire threads share the agent
            super()._tidy()

    def close(self) -> None:
        if self._agent is None:
            return
        if not self.stop_pipeline():
            # A stage thread is still running (stuck inside NIXL, say) and may touch the ring or
            # the agent when it wakes: deregistering or unmapping under it would be a
            # use-after-free. Leaked instead; its link's next call finds the driver closed.
            # (Not under agent_lock: that thread may hold it.)
            log.warning(
                "%s: a staging stage did not stop; leaking the staging ring and the NIXL agent instead of freeing them",
                self.name,
            )
            abandon(self._agent, self._ring_reg, self._ring_map, self._ring_view)
            self._agent = None
            self._remote.clear()
            self._ring_reg = self._ring_map = self._ring_view = None
            return
        # Every stage stopped: nothing touches the ring after this.
        self._quiesce()
        for peer in list(self._remote):
            self.disconnect(peer)
        with self.agent_lock:
            self._drop_receivers()  # their registrations of the ring go before it is unmapped
            if self._ring_reg is not None:
                try:
                    self._agent.deregister_memory(self._ring_reg)
                except Exception:  # noqa: BLE001
                    pass
            self._agent = None
        self._ring_view = None
        if self._ring_map is not None:
            try:
                self._ring_map.close()
            except BufferError:  # a view is still alive; the OS unmaps it at exit
                pass
            self._ring_map = None


class _NixlLink:
    """One chunk per NIXL WRITE; completion read from the transfer state."""

    def __init__(self, driver: NixlStaged, remote: str) -> None:
        self.driver, self.remote = driver, remote

    def post(self, local: int, remote: int, length: int) -> Any:
        d = self.driver
        with d.agent_lock:
            agent = d._agent
            if agent is None:
                raise EngineError(f"{d.name}: closed")
            src = agent.get_xfer_descs([(local, length, 0)], "DRAM")
            dst = agent.get_xfer_descs([(remote, length, 0)], "DRAM")
            handle = agent.initialize_xfer("WRITE", src, dst, self.remote)
            if agent.transfer(handle) == "ERR":
                agent.release_xfer_handle(handle)
                raise EngineError(f"{d.name}: NIXL refused a {length}-byte WRITE to {self.remote}")
        return handle

    def check(self, handle: Any) -> bool:
        d = self.driver
        with d.agent_lock:
            agent = d._agent
            if agent is None:
                raise EngineError(f"{d.name}: closed")
            state = agent.check_xfer_state(handle)
            if state == "PROC":
                return False
            agent.release_xfer_handle(handle)
        if state != "DONE":
            raise EngineError(f"{d.name}: NIXL reported an error for a chunk WRITE to {self.remote}")
        return True
