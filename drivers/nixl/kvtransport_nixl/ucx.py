"""``nixl-ucx``: a NIXL agent per endpoint with the UCX backend.

UCX picks its own transport (shared memory between processes of one host, RDMA across hosts
when the NICs are there, TCP otherwise); the offer reports which one it expects, honouring
``UCX_TLS``, so the user sees the slow path before it is taken.
"""

from __future__ import annotations

import os
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
from kvtransport.spi.errors import ConfigError
from kvtransport.spi.probe import probe_host

from .data_path import NixlDataPath
from .engine_probe import CUDA_IPC_TLS, ENV_VARS, RDMA_TLS, SHM_TLS, allows, probe_nixl
from .posters import ENV_VARS as POSTER_ENV_VARS
from .posters import posters_from_env

#: Estimates. Shared memory as ``kvtransport bench`` measured it between processes here
#: (512 MiB Llama-3-8B requests: 1.6 GB/s with scattered pages, 2.5 GB/s with contiguous ones;
#: the raw NIXL API the same within 10%); TCP as measured with ``UCX_TLS=tcp,self`` (0.8-2.4
#: GB/s); RDMA for a 200 Gb/s NIC. Device memory without GDR goes through UCX's own host
#: bounce buffers, which costs it about half.
SHM_GBPS = 2.0
TCP_GBPS = 1.5
RDMA_GBPS = 20.0
CUDA_IPC_GBPS = 15.0
NO_GDR_FACTOR = 0.5


def _pair_allows(local: PeerView, remote: PeerView, family: set[str]) -> bool:
    return all(allows(view.status.info.get("ucx_tls", "") if view.status else "", family) for view in (local, remote))


def host_wire(
    local: PeerView, remote: PeerView, *, shared_memory: bool = True
) -> tuple[TransferPath, float, str] | None:
    """The transport UCX would take for host memory between the pair (path, GB/s, why):
    shared memory on one host (unless ``shared_memory`` is off), RDMA when both have NICs,
    TCP otherwise; ``None`` when ``UCX_TLS`` leaves none of them."""
    if shared_memory and local.host.host_id == remote.host.host_id and _pair_allows(local, remote, SHM_TLS):
        return TransferPath.SHM, SHM_GBPS, "UCX shared memory between processes of one host"
    if local.host.rdma_devices and remote.host.rdma_devices and _pair_allows(local, remote, RDMA_TLS):
        return TransferPath.RDMA, RDMA_GBPS, "UCX over RDMA"
    if _pair_allows(local, remote, {"tcp"}):
        return TransferPath.TCP, TCP_GBPS, "UCX over TCP (no shared memory or RDMA path)"
    return None


NO_TRANSPORT = "UCX_TLS on one side leaves no transport UCX could use for this pair"


class NixlUCX(NixlDataPath):
    name: ClassVar[str] = "nixl-ucx"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"host", "cuda"}), writes=frozenset({"host", "cuda"})
    )
    env_vars: ClassVar[tuple[str, ...]] = (*ENV_VARS, *POSTER_ENV_VARS)
    raw_engine: ClassVar[str] = "kvtransport_nixl.raw:RawNixl"
    parallel_posts: ClassVar[bool] = True
    #: Each peer writes into a NIXL agent of its own, so ``fence`` can cut it off alone.
    receives_per_peer: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> DriverStatus:
        facts = probe_nixl()
        if not facts.status.available:
            return facts.status
        host = probe_host()
        memory = ["host"] if "DRAM_SEG" in facts.mem_types else []
        notes = {} if memory else {"host": f"{facts.backend} backend cannot register host memory"}
        if "VRAM_SEG" not in facts.mem_types:
            notes["cuda"] = f"{facts.backend} backend cannot register device memory"
        elif not host.cuda_devices:
            notes["cuda"] = f"no CUDA device on this host ({host.cuda_note or 'none visible'})"
        else:
            memory.append("cuda")
        try:
            posters, _ = posters_from_env()
        except ConfigError as exc:
            return replace(facts.status, available=False, reason=str(exc), fix="fix or unset it")
        return replace(
            facts.status,
            # Calibrated models are kept per version: one measured with another number of
            # posting threads does not describe this data path.
            version=f"{facts.status.version}+{posters}p",
            memory=tuple(memory),
            memory_notes=notes,
            info={
                "module": facts.module,
                "backend": facts.backend,
                "ucx_tls": os.environ.get("UCX_TLS", ""),
            },
        )

    @classmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        if local.status is None or remote.status is None:
            return Rejection("not installed on both sides")
        backends = {local.status.info.get("backend", "UCX"), remote.status.info.get("backend", "UCX")}
        if len(backends) > 1:
            return Rejection(f"NIXL backends differ between the peers: {', '.join(sorted(backends))}")
        same_host = local.host.host_id == remote.host.host_id
        device = local.kv_memory.is_cuda or remote.kv_memory.is_cuda
        if (
            same_host
            and device
            and local.kv_memory.is_cuda
            and remote.kv_memory.is_cuda
            and _pair_allows(local, remote, CUDA_IPC_TLS)
        ):
            return Offer(TransferPath.NVLINK, CUDA_IPC_GBPS, "UCX cuda_ipc between processes of one host")
        # Shared memory carries host memory only; device memory goes over RDMA or TCP.
        wire = host_wire(local, remote, shared_memory=not device)
        if wire is None:
            return Rejection(NO_TRANSPORT)
        path, gbps, note = wire
        gdr = all(
            view.host.gdr_for(view.kv_memory.device)[0] for view in (local, remote) if view.kv_memory.device is not None
        )
        if gdr:
            return Offer(path, gbps, note)
        return Offer(
            path, gbps * NO_GDR_FACTOR, note + "; device memory bounced through host by UCX (no GPUDirect RDMA)"
        )
