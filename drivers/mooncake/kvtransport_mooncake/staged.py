"""``mooncake-staged``: device KV through a bounded host staging ring, no GPUDirect RDMA needed.

The ring comes from Mooncake's ``allocate_managed_buffer`` (already registered with the
engine); the pipeline itself is the core's (``kvtransport.staging``). Offered for device KV
only: host KV gains nothing from staging, and ``mooncake-gdr`` serves it directly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from kvtransport.driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverStatus,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.probe import probe_host

from .base import protocol_mismatch
from .data_path import MooncakeDataPath
from .engine_probe import ENV_VARS, cuda_note, probe_engine
from .gdr import RDMA_GBPS, TCP_GBPS

#: Nominal pinned device<->host copy bandwidth of a PCIe 4.0 x16 link.
PCIE_GBPS = 20.0
#: Share of the slower stage the pipeline keeps (copy-out, wire, copy-in overlap imperfectly).
PIPELINE_EFFICIENCY = 0.8


class MooncakeStaged(MooncakeDataPath):
    name: ClassVar[str] = "mooncake-staged"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"cuda"}), writes=frozenset({"cuda"}), two_sided=True
    )
    env_vars: ClassVar[tuple[str, ...]] = ENV_VARS

    @classmethod
    def probe(cls) -> DriverStatus:
        facts = probe_engine()
        if not facts.status.available:
            return facts.status
        host = probe_host()
        note = cuda_note(facts, host, need_gdr=False)
        notes = {"host": "host KV needs no staging; mooncake-gdr serves it directly"}
        if note:
            notes["cuda"] = note
        return replace(
            facts.status,
            memory=() if note else ("cuda",),
            memory_notes=notes,
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
        if not (local.kv_memory.is_cuda and remote.kv_memory.is_cuda):
            return Rejection("stages device KV only; at least one side keeps KV in host memory")
        protocol = local.status.info.get("protocol", "tcp")
        wire = RDMA_GBPS if protocol == "rdma" else TCP_GBPS
        gbps = round(min(PCIE_GBPS, wire) * PIPELINE_EFFICIENCY, 2)
        return Offer(TransferPath.PCIE_STAGED, gbps, f"device->host ring->{protocol}->host ring->device")
