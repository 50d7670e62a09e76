"""What both Mooncake drivers need to know about the engine on this host, probed once.

Importing ``mooncake.engine`` is the real test: it fails differently when the wheel is absent,
when ``libibverbs.so.1`` is missing, and when a CUDA build meets a host without CUDA.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from importlib import metadata

from kvtransport.spi.diagnose import import_failure
from kvtransport.spi.driver import DriverStatus
from kvtransport.spi.probe import HostInfo, probe_host

ENV_PROTOCOL = "KVTRANSPORT_MOONCAKE_PROTOCOL"
ENV_DEVICE = "KVTRANSPORT_MOONCAKE_DEVICE"
ENV_MAX_BATCH = "KVTRANSPORT_MOONCAKE_MAX_BATCH"
ENV_HOSTNAME = "KVTRANSPORT_MOONCAKE_HOSTNAME"
ENV_VARS = (ENV_PROTOCOL, ENV_DEVICE, ENV_MAX_BATCH, ENV_HOSTNAME)

_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


@dataclass(frozen=True)
class EngineFacts:
    status: DriverStatus  # unavailable with the reason, or available (memory left to drivers)
    protocol: str = ""
    protocol_note: str = ""
    build_has_cuda: bool = False
    version: str = ""
    distribution: str = ""


def installed_distribution() -> tuple[str, str]:
    for dist in _DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "", ""


def choose_protocol(host: HostInfo, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(protocol, why): ``rdma`` when RDMA devices exist, else ``tcp``; env can override."""
    env = dict(os.environ) if env is None else env
    forced = env.get(ENV_PROTOCOL, "").strip().lower()
    if forced:
        if forced not in ("tcp", "rdma"):
            return "", f"{ENV_PROTOCOL}={forced!r} is not 'tcp' or 'rdma'"
        if forced == "rdma" and not host.rdma_devices:
            return "", f"{ENV_PROTOCOL}=rdma but this host has {host.rdma_note or 'no RDMA devices'}"
        return forced, f"set by {ENV_PROTOCOL}"
    if env.get("MC_FORCE_TCP", "").strip().lower() in ("1", "true", "yes", "on"):
        return "tcp", "MC_FORCE_TCP is set"
    if host.rdma_devices:
        return "rdma", f"RDMA devices {', '.join(host.rdma_devices)}"
    return "tcp", host.rdma_note or "no RDMA devices"


@functools.lru_cache(maxsize=1)
def probe_engine() -> EngineFacts:
    host = probe_host()
    dist, version = installed_distribution()
    extra = "cuda" if host.cuda_devices else "cpu"
    try:
        import mooncake.engine as engine
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return EngineFacts(
            import_failure(
                exc,
                module="mooncake",
                install=f"pip install 'kvtransport-mooncake[{extra}]'",
                cpu_build_hint=(
                    f"pip uninstall -y {dist or 'mooncake-transfer-engine'} && pip install 'kvtransport-mooncake[cpu]'"
                ),
            ),
            version=version,
            distribution=dist,
        )
    protocol, why = choose_protocol(host)
    if not protocol:
        return EngineFacts(
            DriverStatus(False, why, fix=f"unset {ENV_PROTOCOL} or set it to tcp"),
            version=version,
            distribution=dist,
        )
    return EngineFacts(
        DriverStatus(True, f"Mooncake {version or '?'} ({dist or 'unknown build'}) over {protocol}", version=version),
        protocol=protocol,
        protocol_note=why,
        build_has_cuda=bool(getattr(engine, "SUPPORT_CUDA", False)),
        version=version,
        distribution=dist,
    )


def cuda_note(facts: EngineFacts, host: HostInfo, *, need_gdr: bool) -> str:
    """Why device memory cannot be served here (empty if it can)."""
    if not host.cuda_devices:
        return f"no CUDA device on this host ({host.cuda_note or 'none visible'})"
    if need_gdr:
        if not facts.build_has_cuda:
            return f"this Mooncake build ({facts.distribution}) has no CUDA support; install kvtransport-mooncake[cuda]"
        if facts.protocol != "rdma":
            return f"device memory needs RDMA with GPUDirect, but the protocol is {facts.protocol}"
        if not any(d.gdr for d in host.cuda_devices):
            reasons = "; ".join(f"cuda:{d.index}: {d.gdr_reason}" for d in host.cuda_devices)
            return f"no GPUDirect RDMA ({reasons}); mooncake-staged serves device KV without it"
    return ""
