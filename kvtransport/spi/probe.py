"""Host capabilities: host id, CUDA devices and their GPUDirect RDMA support, RDMA NICs,
engine versions.

Every probe here is fast, imports no transfer engine and no torch, and never raises: what
cannot be known is reported as unknown with the reason. CUDA is asked through the driver API
(``libcuda.so.1``) with ctypes, so a host without torch still reports its GPUs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

# CUdevice_attribute values from cuda.h (stable across CUDA 11.3+).
_CU_ATTR_GPU_DIRECT_RDMA_SUPPORTED = 116
_CU_ATTR_DMA_BUF_SUPPORTED = 124

#: Distributions whose versions the hello reports (engines and their runtimes).
ENGINE_DISTRIBUTIONS = (
    "kvtransport",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "nixl",
    "nixl-cu12",
    "nixl-cu13",
    "torch",
)


@dataclass(frozen=True)
class CudaDevice:
    """One CUDA device and whether a NIC can register its memory directly (GDR)."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str = ""
    gdr: bool | None = None  # None: unknown
    gdr_reason: str = ""


@dataclass(frozen=True)
class HostInfo:
    """What one host can do, as carried in the ``host`` section of a hello."""

    host_id: str
    hostname: str = ""
    cuda_devices: tuple[CudaDevice, ...] = ()
    cuda_note: str = ""  # why no CUDA device is listed, if none is
    rdma_devices: tuple[str, ...] = ()
    rdma_note: str = ""
    peermem: bool = False  # nvidia_peermem / nv_peer_mem kernel module loaded
    versions: Mapping[str, str] = field(default_factory=dict)

    def device(self, index: int) -> CudaDevice | None:
        for dev in self.cuda_devices:
            if dev.index == index:
                return dev
        return None

    def gdr_for(self, index: int) -> tuple[bool, str]:
        """(usable, reason) for registering ``cuda:index`` memory with an RDMA NIC."""
        dev = self.device(index)
        if dev is None:
            note = self.cuda_note or "not listed by the CUDA driver"
            return False, f"cuda:{index} not found on host {self.hostname or self.host_id}: {note}"
        if dev.gdr:
            return True, dev.gdr_reason or "GPUDirect RDMA available"
        return False, dev.gdr_reason or "GPUDirect RDMA support unknown"


def host_id() -> str:
    """An id equal for every process of one host during one boot, different across hosts.

    The kernel's boot id changes at each boot and is shared by all processes (containers too),
    so the hostname is mixed in: two containers of one kernel with different hostnames are
    treated as different hosts, which is the safe side for CUDA IPC and shared memory.
    """
    boot = _read("/proc/sys/kernel/random/boot_id") or _read("/etc/machine-id") or "no-boot-id"
    digest = hashlib.sha256(f"{boot.strip()}|{socket.gethostname()}".encode()).hexdigest()
    return digest[:16]


def machine_key() -> str:
    """An id of this machine that survives reboots (``/etc/machine-id`` with the hostname):
    what a measurement of this machine, like a calibration, is filed under."""
    machine = _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id") or "no-machine-id"
    return hashlib.sha256(f"machine|{machine.strip()}|{socket.gethostname()}".encode()).hexdigest()[:16]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def rdma_devices(root: str = "/sys/class/infiniband") -> tuple[tuple[str, ...], str]:
    """Names of RDMA devices in sysfs, and a note when there are none."""
    try:
        names = tuple(sorted(os.listdir(root)))
    except FileNotFoundError:
        return (), f"no RDMA devices ({root} does not exist)"
    except OSError as exc:
        return (), f"cannot list RDMA devices: {exc}"
    return names, "" if names else f"no RDMA devices under {root}"


def peermem_loaded(modules: str = "/proc/modules") -> bool:
    text = _read(modules)
    return any(line.split(" ", 1)[0] in ("nvidia_peermem", "nv_peer_mem") for line in text.splitlines())


def engine_versions() -> dict[str, str]:
    versions = {}
    for dist in ENGINE_DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _load_libcuda() -> tuple[Any | None, str]:
    try:
        return ctypes.CDLL("libcuda.so.1"), ""
    except OSError as exc:
        if "cannot open shared object" in str(exc):
            return None, "no CUDA driver (libcuda.so.1 not found)"
        return None, f"CUDA driver unusable: {exc}"


def cuda_devices(peermem: bool, have_rdma: bool) -> tuple[tuple[CudaDevice, ...], str]:
    """CUDA devices through the driver API, with GDR support judged per device."""
    lib, note = _load_libcuda()
    if lib is None:
        return (), note
    try:
        rc = lib.cuInit(0)
        if rc != 0:
            return (), f"cuInit failed with CUDA error {rc} (driver present but unusable)"
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return (), "cuDeviceGetCount failed"
        devices = []
        for index in range(count.value):
            devices.append(_describe_device(lib, index, peermem, have_rdma))
        return tuple(devices), "" if devices else "CUDA driver present, no device visible"
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return (), f"CUDA probe failed: {exc}"


def _describe_device(lib: Any, index: int, peermem: bool, have_rdma: bool) -> CudaDevice:
    dev = ctypes.c_int()
    lib.cuDeviceGet(ctypes.byref(dev), index)
    uuid_buf = ctypes.create_string_buffer(16)
    uuid = ""
    if lib.cuDeviceGetUuid(uuid_buf, dev) == 0:
        raw = uuid_buf.raw.hex()
        uuid = f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"
    bus = ctypes.create_string_buffer(32)
    pci = bus.value.decode() if lib.cuDeviceGetPCIBusId(bus, 32, dev) == 0 else ""
    name_buf = ctypes.create_string_buffer(256)
    name = name_buf.value.decode() if lib.cuDeviceGetName(name_buf, 256, dev) == 0 else ""

    def attribute(attr: int) -> int | None:
        value = ctypes.c_int()
        return value.value if lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev) == 0 else None

    gdr_attr = attribute(_CU_ATTR_GPU_DIRECT_RDMA_SUPPORTED)
    dmabuf = attribute(_CU_ATTR_DMA_BUF_SUPPORTED)
    gdr, reason = judge_gdr(gdr_attr, dmabuf, peermem, have_rdma)
    return CudaDevice(index, uuid, pci, name, gdr, reason)


def judge_gdr(gdr_attr: int | None, dmabuf: int | None, peermem: bool, have_rdma: bool) -> tuple[bool | None, str]:
    """Whether a NIC can register this device's memory, from the facts the probe gathered."""
    if not have_rdma:
        return False, "no RDMA NIC on this host, so no GPUDirect RDMA"
    if gdr_attr is None:
        return None, "CUDA driver too old to report GPUDirect RDMA support"
    if gdr_attr == 0:
        return False, "device does not support GPUDirect RDMA (CUDA attribute is 0)"
    if peermem:
        return True, "GPUDirect RDMA via nvidia_peermem"
    if dmabuf:
        return True, "GPUDirect RDMA via dma-buf registration"
    return False, (
        "GPUDirect RDMA supported by the device but not enabled: load nvidia_peermem "
        "(modprobe nvidia_peermem) or use the open kernel modules for dma-buf"
    )


@functools.lru_cache(maxsize=1)
def probe_host() -> HostInfo:
    """This host's capabilities (computed once per process)."""
    rdma, rdma_note = rdma_devices()
    peermem = peermem_loaded()
    devices, cuda_note = cuda_devices(peermem, bool(rdma))
    return HostInfo(
        host_id=host_id(),
        hostname=socket.gethostname(),
        cuda_devices=devices,
        cuda_note=cuda_note,
        rdma_devices=rdma,
        rdma_note=rdma_note,
        peermem=peermem,
        versions=engine_versions(),
    )
