"""Which RDMA devices a Mooncake engine is started on: ``initialize``'s ``device_name``.

Mooncake takes a comma-separated list of RDMA devices and stripes a batch's slices across them;
an empty list lets it use every device it finds, and choose among them by its own topology
(nearest to the memory first). An engine here serves one GPU's KV; it is given that GPU's rails
only when the user forces them (``KVTRANSPORT_RAILS``), and only under the ``rdma`` protocol:
a list of the nearest rails alone would take away Mooncake's way to a peer reachable only
through another NIC (a rail-only fabric). ``KVTRANSPORT_MOONCAKE_DEVICE``, when set, is passed
as it is and wins. ``kvtransport doctor`` says which rails topology finds nearest either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvtransport.spi.topology import GpuRails, forced_rails, mooncake_device_names, rails_for_gpu

from .engine_probe import ENV_DEVICE


def device_filter(
    protocol: str,
    gpu: int | None,
    env: Mapping[str, str],
    rails: Callable[[int], GpuRails | None] = rails_for_gpu,
) -> tuple[str, str]:
    """(``device_name`` for ``initialize``, why). ``gpu``: the CUDA device of the KV (``None``:
    host memory). Raises ConfigError for a bad ``KVTRANSPORT_RAILS``."""
    explicit = env.get(ENV_DEVICE, "").strip()
    if explicit:
        return explicit, f"set by {ENV_DEVICE}"
    if protocol != "rdma":
        return "", f"protocol {protocol}: no RDMA device to choose"
    chosen, why = forced_rails(gpu, rails, "every RDMA device, Mooncake's choice")
    if chosen is None:
        return "", why
    names = mooncake_device_names(chosen)
    if not names:
        return "", f"{chosen.reason}, no RDMA device among them: every RDMA device (Mooncake's choice)"
    return names, chosen.reason
