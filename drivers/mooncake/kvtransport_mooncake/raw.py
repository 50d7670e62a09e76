"""Mooncake used directly, for ``kvtransport bench``'s baseline: one engine per side,
``batch_transfer_sync_write`` of the same descriptors, split only where the engine itself
requires it (its per-batch descriptor limit)."""

from __future__ import annotations

import msgpack

from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs

from .engine import Engine


class RawMooncake:
    def __init__(self, regions: RegionSet, host: str) -> None:
        # Engine only starts and registers; write() below calls the engine itself.
        self._started = Engine("raw mooncake", host)
        regs = regions.all()
        self._started.register([r.ptr for r in regs], [r.length for r in regs])
        self._engine = self._started.engine
        self._session = ""

    def info(self) -> bytes:
        data = msgpack.packb(self._started.session)
        assert isinstance(data, bytes)
        return data

    def connect(self, info: bytes) -> None:
        self._session = str(msgpack.unpackb(info))

    def write(self, runs: Runs) -> None:
        src, dst, lengths = runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()
        step = self._started.max_batch
        for i in range(0, len(src), step):
            rc = self._engine.batch_transfer_sync_write(
                self._session, src[i : i + step], dst[i : i + step], lengths[i : i + step]
            )
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

    def close(self) -> None:
        self._started.close()
