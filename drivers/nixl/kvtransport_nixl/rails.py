"""Which network devices UCX uses under a NIXL agent: ``UCX_NET_DEVICES``.

UCX reads ``UCX_NET_DEVICES`` (``mlx5_0:1,mlx5_1:1``: device:port per RDMA device, the
interface name per IP device) when NIXL creates its UCX backend, and spreads large transfers
over the devices listed. An agent here serves one GPU's KV, so it is given that GPU's rails
(``spi.topology``: the nearest ones, or those ``KVTRANSPORT_RAILS`` forces). Left alone:

- a ``UCX_NET_DEVICES`` the user set (respected, and said so in the log);
- host-memory KV (no GPU to be near);
- IP rails chosen by topology (not forced): limiting UCX's TCP devices could cut it off from a
  peer it reaches through another interface, so only RDMA rails, or rails the user forces, are
  applied.

The variable is set only while the agent and its backend are made, under a lock, and put back
after: the process's other users of UCX keep their own setting.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping

from kvtransport.spi.topology import GpuRails, rails_for_gpu, ucx_net_devices

ENV_UCX_NET_DEVICES = "UCX_NET_DEVICES"

_env_lock = threading.Lock()


def net_devices(
    gpu: int | None, env: Mapping[str, str], rails: Callable[[int], GpuRails | None] = rails_for_gpu
) -> tuple[str, str]:
    """(``UCX_NET_DEVICES`` for an agent serving ``gpu``'s KV, "" to leave UCX's choice; why).
    Raises ConfigError for a bad ``KVTRANSPORT_RAILS``."""
    user = env.get(ENV_UCX_NET_DEVICES, "").strip()
    if user:
        return "", f"{ENV_UCX_NET_DEVICES}={user} set by the user: kept"
    if gpu is None:
        return "", "host-memory KV: UCX's own choice of devices"
    chosen = rails(gpu)
    if chosen is None:
        return "", f"cuda:{gpu} not found in sysfs: UCX's own choice of devices"
    if not chosen.rails:
        return "", f"{chosen.reason}: UCX's own choice of devices"
    if not chosen.forced and any(r.kind != "rdma" for r in chosen.rails):
        return "", f"{chosen.reason}: IP rails are left to UCX (force them with KVTRANSPORT_RAILS)"
    return ucx_net_devices(chosen), chosen.reason


@contextlib.contextmanager
def ucx_net_devices_set(value: str) -> Iterator[None]:
    """``UCX_NET_DEVICES=value`` while the block runs (nothing when ``value`` is empty)."""
    if not value:
        yield
        return
    with _env_lock:
        before = os.environ.get(ENV_UCX_NET_DEVICES)
        os.environ[ENV_UCX_NET_DEVICES] = value
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ENV_UCX_NET_DEVICES, None)
            else:
                os.environ[ENV_UCX_NET_DEVICES] = before
