"""The staged path: KV pages through a bounded host ring, pipelined, with credit flow control.

Any driver that can write host memory to a peer gets a staged variant from this package: it
provides the ring (host memory its engine registered), a :class:`WireLink` that starts writing
a chunk to the peer's ring and tells when it is there, and the endpoint's context. The pipeline
does the rest. The pieces:

- :mod:`.config`: ring and chunk sizes (``KVTRANSPORT_STAGING_*``);
- :mod:`.copy`: the copy-engine seam (memcpy here, CUDA streams in ``kvtransport.staging.cuda_copy``)
  and the wire seam;
- :mod:`.chunks`: runs cut into slot-sized chunks;
- :mod:`.notices`: the want / grant / lend / release / revoke / chunk notices and their typed schema;
- :mod:`.pipeline`: :class:`StagingPipeline`, the one object a driver holds (threads, connections,
  notices), built from :mod:`.ring_state` (records, the lock, slot accounting), :mod:`.sending`
  (submits, credits, the gather stage), :mod:`.wire_stage` (the wire stage) and :mod:`.receiving`
  (grants, lends, revokes, the scatter stage);
- :mod:`.transport`: :class:`StagedTransport`, the SPI half every staged driver shares.
"""

from __future__ import annotations

from kvtransport.staging.chunks import Chunk, chunk_runs
from kvtransport.staging.config import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_RING_BYTES,
    ENV_CHUNK_BYTES,
    ENV_RING_BYTES,
    OPT_CHUNK,
    OPT_RING,
    OPT_SCATTER_DELAY,
    RingConfig,
)
from kvtransport.staging.copy import CopyEngine, MemcpyCopyEngine, WireLink
from kvtransport.staging.pipeline import WIRE_POLL_S, RingUsage, StagingPipeline
from kvtransport.staging.transport import StagedTransport

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RING_BYTES",
    "ENV_CHUNK_BYTES",
    "ENV_RING_BYTES",
    "OPT_CHUNK",
    "OPT_RING",
    "OPT_SCATTER_DELAY",
    "WIRE_POLL_S",
    "Chunk",
    "CopyEngine",
    "MemcpyCopyEngine",
    "RingConfig",
    "RingUsage",
    "StagedTransport",
    "StagingPipeline",
    "WireLink",
    "chunk_runs",
]
