"""A third-party driver, packaged as its own distribution: copies between two endpoints of one
process with memmove. It exists to prove the plugin path (entry points from a separate package)
and to show driver authors a complete, small driver."""

from __future__ import annotations

import ctypes
import os
from typing import ClassVar

from kvtransport.spi.driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverStatus,
    KVTransport,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.spi.errors import DriverError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs


class ExampleMemcpy(KVTransport):
    name: ClassVar[str] = "example-memcpy"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"host"}), writes=frozenset({"host"}), same_host_only=True
    )
    env_vars: ClassVar[tuple[str, ...]] = ("KVTRANSPORT_EXAMPLE_GBPS",)

    @classmethod
    def probe(cls) -> DriverStatus:
        return DriverStatus(True, "memmove inside one process", memory=("host",), info={"pid": str(os.getpid())})

    @classmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        if local.status is None or remote.status is None:
            return Rejection("not installed on both sides")
        if local.status.info.get("pid") != remote.status.info.get("pid"):
            return Rejection("copies only between endpoints of one process")
        gbps = float(os.environ.get("KVTRANSPORT_EXAMPLE_GBPS", "8"))
        return Offer(TransferPath.MEMCPY, gbps, "memmove in one process")

    def __init__(self, context):  # type: ignore[no-untyped-def]
        super().__init__(context)
        self._done: dict[int, bool] = {}
        self._next = 0

    def open(self, regions: RegionSet) -> bytes:
        return b""

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        return None

    def submit(self, peer: str, runs: Runs) -> int:
        for src, dst, length in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
            ctypes.memmove(dst, src, length)
        self._next += 1
        self._done[self._next] = True
        return self._next

    def poll(self, handle: int) -> bool:
        if not self._done.pop(handle, False):
            raise DriverError(f"handle {handle} is unknown")
        return True

    def abort(self, handle: int) -> None:
        self._done.pop(handle, None)

    def pending(self) -> int:
        return len(self._done)

    def close(self) -> None:
        self._done.clear()
