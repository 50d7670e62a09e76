"""Which network devices UCX uses under a NIXL agent: the UCX backend's ``device_list``.

NIXL's UCX backend takes a ``device_list`` parameter (``mlx5_0:1, mlx5_1:1``: device:port
per RDMA device, the interface name per IP device) and makes its UCX context on those devices
only, spreading large transfers over them. It is given only when the user forces rails
(``KVTRANSPORT_RAILS``) for the GPU whose KV the agent serves: a list of the nearest RDMA
rails would also drop UCX's TCP devices, and with them a peer reachable only over TCP, or over
another fabric; without a forced list UCX chooses among every device itself (nearest first).
``kvtransport doctor`` says which rails topology finds nearest either way. Left alone:

- a ``UCX_NET_DEVICES`` the user set (respected, and said so in the log);
- host-memory KV (no GPU to be near).

A backend parameter, not the environment: ``UCX_NET_DEVICES`` set for the time of a backend's
creation would race with every other thread of the process reading its environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvtransport.spi.topology import GpuRails, forced_rails, rails_for_gpu, ucx_net_devices

ENV_UCX_NET_DEVICES = "UCX_NET_DEVICES"
#: The UCX backend's parameter naming the devices its context uses (NIXL's ucx_backend).
DEVICE_LIST = "device_list"


def net_devices(
    gpu: int | None, env: Mapping[str, str], rails: Callable[[int], GpuRails | None] = rails_for_gpu
) -> tuple[str, str]:
    """(``device_list`` for an agent serving ``gpu``'s KV, "" to leave UCX's choice; why).
    Raises ConfigError for a bad ``KVTRANSPORT_RAILS``."""
    user = env.get(ENV_UCX_NET_DEVICES, "").strip()
    if user:
        return "", f"{ENV_UCX_NET_DEVICES}={user} set by the user: kept"
    chosen, why = forced_rails(gpu, rails, "UCX's own choice among every device")
    if chosen is None:
        return "", why
    return ", ".join(d for d in ucx_net_devices(chosen).split(",") if d), chosen.reason
