"""The NIXL data path of ``nixl-ucx``."""

from __future__ import annotations

from kvtransport.driver import KVTransport
from kvtransport.errors import DriverUnavailable
from kvtransport.memory import RegionSet
from kvtransport.plan import Runs


class NixlDataPath(KVTransport):
    """Abstract base; the byte-moving methods land with the real-engine data path."""

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
