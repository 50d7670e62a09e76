"""``mooncake-gdr``: zero-copy writes with KV registered where it lives.

Host memory works on any host (over TCP without RDMA NICs). Device memory is offered only
where the NIC can register it directly (GPUDirect RDMA on every device involved); otherwise the
probe says why and the negotiation moves on (to ``mooncake-staged``), never "try and see".
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from kvtransport.spi.driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverStatus,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.spi.probe import probe_host

from .base import protocol_mismatch
from .data_path import MooncakeDataPath
from .engine_probe import ENV_VARS, cuda_note, probe_engine

#: Estimates: a 200 Gb/s NIC; TCP as ``kvtransport bench`` measured it on loopback here (512 MiB
#: Llama-3-8B requests: 0.6 GB/s with scattered pages, 1.5 GB/s with contiguous ones).
RDMA_GBPS = 20.0
TCP_GBPS = 1.0


class MooncakeGDR(MooncakeDataPath):
    name: ClassVar[str] = "mooncake-gdr"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"host", "cuda"}), writes=frozenset({"host", "cuda"})
    )
    env_vars: ClassVar[tuple[str, ...]] = ENV_VARS
    raw_engine: ClassVar[str] = "kvtransport_mooncake.raw:RawMooncake"
    #: Each peer writes into a receive engine of its own, so ``fence`` can cut it off alone.
    receives_per_peer: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> DriverStatus:
        facts = probe_engine()
        if not facts.status.available:
            return facts.status
        host = probe_host()
        note = cuda_note(facts, host, need_gdr=True)
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
        for side, view in (("local", local), ("remote", remote)):
            if view.kv_memory.is_cuda:
                assert view.kv_memory.device is not None
                ok, why = view.host.gdr_for(view.kv_memory.device)
                if not ok:
                    return Rejection(f"{side} KV on {view.kv_memory}: {why}")
        protocol = local.status.info.get("protocol", "tcp")
        if protocol == "rdma":
            return Offer(TransferPath.RDMA, RDMA_GBPS, "zero-copy RDMA writes")
        return Offer(TransferPath.TCP, TCP_GBPS, "Mooncake TCP transport (no RDMA devices)")
