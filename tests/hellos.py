"""Builders of synthetic hellos for negotiation tests: hosts with or without GPUs, GDR, RDMA,
and the driver statuses such hosts report."""

from __future__ import annotations

import dataclasses

from kvtransport.negotiation.hello import DriverHello, Hello
from kvtransport.negotiation.registry import Policy
from kvtransport.spi.driver import DriverStatus
from kvtransport.spi.memory import KVLayout, MemoryKind
from kvtransport.spi.probe import CudaDevice, HostInfo
from kvtransport.spi.tp_map import held_heads
from kvtransport_cuda.local import CudaLocal
from kvtransport_mooncake.gdr import MooncakeGDR
from kvtransport_mooncake.staged import MooncakeStaged
from kvtransport_nixl.staged import NixlStaged
from kvtransport_nixl.ucx import NixlUCX

FIRST_PARTY = {cls.name: cls for cls in (CudaLocal, MooncakeGDR, MooncakeStaged, NixlUCX, NixlStaged)}


def host(host_id: str, *, gpus: int = 0, gdr: bool = False, rdma: bool = False) -> HostInfo:
    devices = tuple(
        CudaDevice(
            i,
            f"GPU-{host_id}-{i}",
            f"0000:{i:02x}:00.0",
            "H100",
            gdr if rdma else False,
            "via nvidia_peermem" if gdr and rdma else "no GDR",
        )
        for i in range(gpus)
    )
    return HostInfo(
        host_id=host_id,
        hostname=host_id,
        cuda_devices=devices,
        cuda_note="" if gpus else "no CUDA driver (libcuda.so.1 not found)",
        rdma_devices=("mlx5_0",) if rdma else (),
        rdma_note="" if rdma else "no RDMA devices",
        peermem=gdr,
    )


def statuses(
    h: HostInfo, *, mooncake: bool = True, nixl: bool = True, ucx_tls: str = "", protocol: str | None = None
) -> dict[str, DriverHello]:
    """The statuses the first-party drivers' probes report on a host like ``h``."""
    proto = protocol or ("rdma" if h.rdma_devices else "tcp")
    gpu = bool(h.cuda_devices)
    gdr = gpu and proto == "rdma" and any(d.gdr for d in h.cuda_devices)
    out: dict[str, DriverStatus] = {
        "cuda-local": DriverStatus(True, "CUDA IPC", memory=("cuda",))
        if gpu
        else DriverStatus(False, "no CUDA device: no CUDA driver", fix="needs NVIDIA GPUs"),
    }
    if mooncake:
        info = {"protocol": proto}
        out["mooncake-gdr"] = DriverStatus(
            True,
            "Mooncake",
            memory=("host", "cuda") if gdr else ("host",),
            memory_notes={} if gdr else {"cuda": "no GPUDirect RDMA"},
            info=info,
        )
        out["mooncake-staged"] = DriverStatus(
            True,
            "Mooncake",
            memory=("host", "cuda") if gpu else ("host",),
            memory_notes={} if gpu else {"cuda": "no CUDA device"},
            info=info,
        )
    else:
        missing = DriverStatus(
            False,
            "engine not installed (no module 'mooncake')",
            fix="pip install 'kvtransport-mooncake[cpu]'",
        )
        out["mooncake-gdr"] = out["mooncake-staged"] = missing
    # nixl-staged reports what nixl-ucx reports: both are the NIXL probe on this host.
    out["nixl-ucx"] = out["nixl-staged"] = (
        DriverStatus(
            True,
            "NIXL",
            memory=("host", "cuda") if gpu else ("host",),
            info={"backend": "UCX", "ucx_tls": ucx_tls},
        )
        if nixl
        else DriverStatus(False, "engine not installed", fix="pip install kvtransport-nixl")
    )
    return {
        name: DriverHello(
            name,
            distribution="test",
            api_version=1,
            capabilities=FIRST_PARTY[name].capabilities,
            status=status,
        )
        for name, status in out.items()
    }


def sliced_layout(memory: str = "host", tp_size: int = 2, tp_rank: int = 0) -> KVLayout:
    """Llama-3-8B's layout on TP rank ``tp_rank`` of ``tp_size`` (its share of the 8 KV heads)."""
    heads = len(held_heads(8, tp_size, tp_rank))
    return dataclasses.replace(
        KVLayout.llama3_8b(MemoryKind.parse(memory)),
        kv_item_lens=(16 * heads * 128 * 2,) * 64,
        num_kv_heads=heads,
        total_kv_heads=8,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def hello(
    h: HostInfo,
    memory: str = "host",
    *,
    policy: Policy | None = None,
    endpoint: str | None = None,
    layout: KVLayout | None = None,
    **kw: object,
) -> Hello:
    return Hello(
        endpoint=endpoint or f"ep@{h.host_id}",
        host=h,
        drivers=statuses(h, **kw),  # type: ignore[arg-type]
        layout=layout or KVLayout.llama3_8b(MemoryKind.parse(memory)),
        policy=policy or Policy(),
    )
