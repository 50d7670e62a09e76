"""An in-process fake driver for the core's tests and for fault injection.

It copies with memmove between registered regions and enforces the real contract: ``open``
once before use, ``connect`` before ``submit``, every run inside this side's and the peer's
registered regions. Between processes it works on buffers from :mod:`kvtransport.tools.shm`
(it maps the peer's buffers itself). Options (``driver_options`` of an endpoint) inject faults:

- ``fake.delay``: seconds before a batch completes;
- ``fake.fail``: ``submit`` or ``poll`` makes every batch fail with an ``EngineError``;
- ``fake.fail_after``: the first N batches succeed, the rest fail;
- ``fake.lose``: ``1`` makes batches never complete (a lost completion);
- ``fake.settle``: seconds an aborted batch may still be writing (``settled`` answers ``False``
  until then), as with an engine that cannot cancel what it posted.
- ``fake.fence``: when ``fence`` answers ``True`` for a departed peer: ``N`` from its N-th call
  on (``1``: at once); unset, the SPI's default (never for the one-sided fake).

It is not registered under ``kvtransport.drivers``; tests pass it to an endpoint explicitly.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import ClassVar

import msgpack
import numpy as np

from kvtransport.spi.driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverContext,
    DriverStatus,
    KVTransport,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.spi.errors import DriverError, EngineError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs, check_runs_within
from kvtransport.tools import shm


class FakeDriver(KVTransport):
    name: ClassVar[str] = "fake"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"host"}), writes=frozenset({"host"}), same_host_only=True
    )
    #: Pure Python, no thread state: the core's tests cover submits and polls from the caller's thread.
    thread_agnostic: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> DriverStatus:
        return DriverStatus(True, "in-process fake (tests only)", memory=("host",), info={"pid": str(os.getpid())})

    @classmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        return Offer(TransferPath.MEMCPY, 5.0, "fake memmove through shared mappings")

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        opts = context.options
        self.delay = float(opts.get("fake.delay", "0"))
        self.fail = opts.get("fake.fail", "")
        self.fail_after = int(opts.get("fake.fail_after", "-1"))
        self.lose = opts.get("fake.lose", "") == "1"
        self.settle = float(opts.get("fake.settle", "0"))
        self.fence_from = int(opts.get("fake.fence", "0") or 0)
        self.fence_calls: dict[str, int] = {}  # peer -> how often fence was asked
        self.settling: dict[int, float] = {}  # aborted handle -> when its writes have stopped
        self.regions: RegionSet | None = None
        self.peers: dict[str, tuple[RegionSet, dict[int, int], list[shm.SharedBuffer]]] = {}
        self.identities: dict[str, tuple[object, ...]] = {}  # peer -> (pid, its regions)
        self.in_flight: dict[int, tuple[float, str]] = {}  # handle -> (completion time, peer)
        self.failed: dict[int, str] = {}
        self.aborted = 0  # batches aborted so far
        self.submitted = 0
        self._next = 0
        self.closed = False

    def open(self, regions: RegionSet) -> bytes:
        if self.regions is not None:
            raise DriverError("fake: open() called twice")
        self.regions = regions
        described = []
        for r in regions.all():
            seg = shm.segment_of(r.ptr, r.length)
            described.append(
                {"ptr": r.ptr, "length": r.length, "path": seg[0] if seg else "", "offset": seg[1] if seg else 0}
            )
        data = msgpack.packb({"pid": os.getpid(), "regions": described})
        assert isinstance(data, bytes)
        return data

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        if self.regions is None:
            raise DriverError("fake: connect() before open()")
        doc = msgpack.unpackb(info)
        same_process = doc["pid"] == os.getpid()
        if same_process and any(
            r["ptr"] < mine.end and mine.ptr < r["ptr"] + r["length"]
            for r in doc["regions"]
            for mine in self.regions.all()
        ):
            raise DriverError("fake: the peer's regions are this endpoint's own (a mirrored connection info)")
        identity = (doc["pid"], tuple(sorted((r["ptr"], r["length"], r["path"], r["offset"]) for r in doc["regions"])))
        if identity in self.identities.values():
            # The same memory, however the info is encoded: writes to "this" peer would land in
            # another connected peer's pool.
            raise DriverError("fake: the peer presents the identity (process and regions) of another connected peer")
        translate: dict[int, int] = {}
        mapped: list[shm.SharedBuffer] = []
        for r in doc["regions"]:
            if same_process:
                translate[r["ptr"]] = r["ptr"]
            elif r["path"]:
                buf = shm.attach(r["path"], r["offset"] + r["length"])
                mapped.append(buf)
                translate[r["ptr"]] = buf.ptr + r["offset"]
            else:
                raise DriverError(f"fake: peer region {r['ptr']:#x} is not in shared memory; cannot reach it")
        self.peers[peer] = (peer_regions, translate, mapped)
        self.identities[peer] = identity

    def submit(self, peer: str, runs: Runs) -> int:
        if self.regions is None or peer not in self.peers:
            raise DriverError(f"fake: submit to {peer!r} before open()/connect()")
        peer_regions, translate, _ = self.peers[peer]
        check_runs_within(runs.src, runs.length, self.regions.all(), "fake source")
        check_runs_within(runs.dst, runs.length, peer_regions.all(), "fake destination")
        self.submitted += 1
        self._next += 1
        handle = self._next
        failing = self.fail == "submit" or (0 <= self.fail_after < self.submitted)
        if failing:
            raise EngineError(f"fake: injected failure on batch {self.submitted}")
        bases = sorted(translate)
        for src, dst, length in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
            base = _region_base(bases, dst)
            ctypes.memmove(translate[base] + (dst - base), src, length)
        if self.fail == "poll":
            self.failed[handle] = "injected failure at completion"
        self.in_flight[handle] = (float("inf") if self.lose else time.monotonic() + self.delay, peer)
        return handle

    def poll(self, handle: int) -> bool:
        if handle in self.failed:
            self.in_flight.pop(handle, None)
            raise EngineError(f"fake: {self.failed.pop(handle)} (batch {handle})")
        entry = self.in_flight.get(handle)
        if entry is None:
            raise DriverError(f"fake: unknown handle {handle}")
        if time.monotonic() < entry[0]:
            return False
        del self.in_flight[handle]
        return True

    def abort(self, handle: int) -> None:
        if self.in_flight.pop(handle, None) is not None and self.settle > 0:
            self.settling[handle] = time.monotonic() + self.settle
        self.failed.pop(handle, None)
        self.aborted += 1

    def settled(self, handle: int) -> bool:
        if time.monotonic() < self.settling.get(handle, 0.0):
            return False
        self.settling.pop(handle, None)
        return True

    def pending(self) -> int:
        return len(self.in_flight.keys() | self.failed.keys())

    def fence(self, peer: str) -> bool:
        calls = self.fence_calls[peer] = self.fence_calls.get(peer, 0) + 1
        if not self.fence_from:
            return super().fence(peer)  # the SPI's default: one-sided never, two-sided once idle
        return self.fence_from <= calls

    def disconnect(self, peer: str) -> None:
        self.identities.pop(peer, None)
        entry = self.peers.pop(peer, None)
        if entry:
            for buf in entry[2]:
                buf.close()
        for handle, (_, owner) in list(self.in_flight.items()):
            if owner == peer:
                self.failed[handle] = f"peer {peer} disconnected"

    def close(self) -> None:
        for peer in list(self.peers):
            self.disconnect(peer)
        self.in_flight.clear()
        self.failed.clear()
        self.closed = True


def _region_base(bases: list[int], addr: int) -> int:
    i = int(np.searchsorted(np.array(bases, dtype=np.uint64), np.uint64(addr), side="right")) - 1
    return bases[i]


class FakeTwoSided(FakeDriver):
    """The fake as a two-sided driver: each batch sends a notice, and the receiver's inbound
    work for a notice takes ``fake.inbound_delay`` seconds (a copy-in from a staging ring)."""

    name: ClassVar[str] = "fake-two-sided"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"host"}), writes=frozenset({"host"}), same_host_only=True, two_sided=True
    )

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        self.inbound_delay = float(context.options.get("fake.inbound_delay", "0.2"))
        self.inbound_until: dict[str, float] = {}
        self.notices: list[bytes] = []

    def submit(self, peer: str, runs: Runs) -> int:
        handle = super().submit(peer, runs)
        self.context.send_notice(peer, msgpack.packb({"batch": handle, "bytes": runs.total_bytes}))
        return handle

    def on_notice(self, peer: str, payload: bytes) -> None:
        self.notices.append(payload)
        self.inbound_until[peer] = time.monotonic() + self.inbound_delay

    def inbound_idle(self, peer: str) -> bool:
        return time.monotonic() >= self.inbound_until.get(peer, 0.0)
