"""``cuda-local``: GPU to GPU on one host through CUDA IPC memory handles.

Offered only when both peers share the host id and keep KV in device memory; peer copies when
the two devices differ, a device-local copy when they are the same GPU.
"""

from __future__ import annotations

from typing import ClassVar

from kvtransport.driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverStatus,
    KVTransport,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.errors import DriverUnavailable
from kvtransport.memory import RegionSet
from kvtransport.plan import Runs
from kvtransport.probe import probe_host

#: Nominal: a peer copy over PCIe 4.0 x16; a copy inside one H100-class device.
PEER_COPY_GBPS = 20.0
SAME_DEVICE_GBPS = 200.0


class CudaLocal(KVTransport):
    name: ClassVar[str] = "cuda-local"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"cuda"}), writes=frozenset({"cuda"}), same_host_only=True
    )

    @classmethod
    def probe(cls) -> DriverStatus:
        host = probe_host()
        if not host.cuda_devices:
            return DriverStatus(
                False,
                f"no CUDA device: {host.cuda_note or 'the CUDA driver lists none'}",
                fix="cuda-local needs NVIDIA GPUs and the CUDA driver (libcuda.so.1)",
            )
        return DriverStatus(
            True,
            f"CUDA IPC on {len(host.cuda_devices)} device(s)",
            memory=("cuda",),
            memory_notes={"host": "cuda-local moves device memory only"},
            info={"devices": ",".join(d.uuid for d in host.cuda_devices)},
        )

    @classmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        if local.host.host_id != remote.host.host_id:
            return Rejection("CUDA IPC needs both peers on one host")
        if not (local.kv_memory.is_cuda and remote.kv_memory.is_cuda):
            return Rejection("moves device memory only; a side keeps KV in host memory")
        assert local.kv_memory.device is not None and remote.kv_memory.device is not None
        a = local.host.device(local.kv_memory.device)
        b = remote.host.device(remote.kv_memory.device)
        if a is None or b is None:
            return Rejection("a side's KV device is not among its host's CUDA devices")
        if a.uuid == b.uuid:
            return Offer(TransferPath.MEMCPY, SAME_DEVICE_GBPS, f"both on {a.uuid}: device-local copy")
        return Offer(TransferPath.PCIE, PEER_COPY_GBPS, "peer copy between devices of one host")

    # The data path (IPC handles, cudaMemcpyAsync on a stream per peer) is not implemented yet.
    def _not_yet(self) -> DriverUnavailable:
        return DriverUnavailable(f"{self.name}: the data path is not implemented in this release")

    def open(self, regions: RegionSet) -> bytes:
        raise self._not_yet()

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        raise self._not_yet()

    def submit(self, peer: str, runs: Runs) -> int:
        raise self._not_yet()

    def poll(self, handle: int) -> bool:
        raise self._not_yet()

    def abort(self, handle: int) -> None:
        raise self._not_yet()

    def close(self) -> None:
        return None
