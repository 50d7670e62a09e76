"""``cuda-local``: GPU to GPU on one host through CUDA IPC memory handles.

Offered only when both peers share the host id and keep KV in device memory; peer copies when
the two devices differ, a device-local copy when they are the same GPU.

Data path: ``open`` exports an IPC handle for every allocation holding a KV region (handles
name whole allocations, so a region inside a caching allocator's block travels as block +
offset); ``connect`` opens the peer's handles once; each batch is one ``cuMemcpyAsync`` per run
on the peer's stream, and an event recorded after them says when it is done. Aux slots live in
host memory, which IPC handles cannot reach: their bytes travel in a notice over the control
channel (a few hundred bytes per request) and the receiver writes them into its aux region
after checking the destination, before the sender's "done" arrives.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from kvtransport.spi import process_sockets
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
from kvtransport.spi.errors import DriverError, KVTransportError, ProtocolError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs, check_runs_within
from kvtransport.spi.probe import probe_host

log = logging.getLogger(__name__)

#: Departed peers whose process ``fence`` still watches.
MAX_DEPARTED = 256

#: Nominal: a peer copy over PCIe 4.0 x16; a copy inside one H100-class device.
PEER_COPY_GBPS = 20.0
SAME_DEVICE_GBPS = 200.0


class CudaLocal(KVTransport):
    name: ClassVar[str] = "cuda-local"
    api_version: ClassVar[int] = DRIVER_API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        reads=frozenset({"cuda"}), writes=frozenset({"cuda"}), same_host_only=True, two_sided=True
    )

    @classmethod
    def probe(cls) -> DriverStatus:
        host = probe_host()
        if not host.cuda_devices:
            return DriverStatus(
                False,
                f"no CUDA device: {host.cuda_note or 'the CUDA driver lists none'}",
                fix="cuda-local needs NVIDIA GPUs and the CUDA driver (libcuda.so.1)",
            )
        return DriverStatus(
            True,
            f"CUDA IPC on {len(host.cuda_devices)} device(s)",
            memory=("cuda",),
            memory_notes={"host": "cuda-local moves device memory only"},
            info={"devices": ",".join(d.uuid for d in host.cuda_devices)},
        )

    @classmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        if local.host.host_id != remote.host.host_id:
            return Rejection("CUDA IPC needs both peers on one host")
        if not (local.kv_memory.is_cuda and remote.kv_memory.is_cuda):
            return Rejection("moves device memory only; a side keeps KV in host memory")
        assert local.kv_memory.device is not None and remote.kv_memory.device is not None
        a = local.host.device(local.kv_memory.device)
        b = remote.host.device(remote.kv_memory.device)
        if a is None or b is None:
            return Rejection("a side's KV device is not among its host's CUDA devices")
        if a.uuid == b.uuid:
            return Offer(TransferPath.MEMCPY, SAME_DEVICE_GBPS, f"both on {a.uuid}: device-local copy")
        return Offer(TransferPath.PCIE, PEER_COPY_GBPS, "peer copy between devices of one host")

    # -- data path ---------------------------------------------------------------------------

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        self._cuda: Any = None
        self._regions: RegionSet | None = None
        self._peers: dict[str, _Peer] = {}
        self._batches: dict[int, tuple[str, Any]] = {}
        self._settling: dict[int, Any] = {}  # aborted handle -> its event, until its copies ended
        self._next = 0
        #: peer -> the process that writes into this side's memory (``process_sockets.identity``)
        self._processes: dict[str, process_sockets.Identity] = {}
        #: ... of departed peers, for ``fence`` asked again (oldest dropped first)
        self._departed: collections.OrderedDict[str, process_sockets.Identity] = collections.OrderedDict()

    def open(self, regions: RegionSet) -> bytes:
        if self._cuda is not None:
            raise DriverError(f"{self.name}: open() called twice")
        device = regions.kv_kind.device
        if device is None:
            raise DriverError(f"{self.name}: KV is in host memory; cuda-local moves device memory only")
        from kvtransport.staging.cuda_copy import CudaDriver

        cuda = CudaDriver(device)
        exported: list[dict[str, Any]] = []
        handles: dict[int, bytes] = {}
        try:
            for r in regions.all():
                if not r.kind.is_cuda:
                    exported.append({"ptr": r.ptr, "length": r.length})
                    continue
                base, _ = cuda.allocation_of(r.ptr)
                if base not in handles:
                    handles[base] = cuda.ipc_handle(base)
                exported.append({"ptr": r.ptr, "length": r.length, "base": base, "handle": handles[base]})
        except KVTransportError as exc:
            cuda.release()
            raise DriverError(
                f"{self.name}: cannot export KV memory over CUDA IPC ({exc}); memory from cuMemCreate "
                "(e.g. PyTorch expandable segments) has no IPC handle"
            ) from exc
        self._cuda, self._regions = cuda, regions
        info = msgpack.packb({"device": device, "regions": exported, **process_sockets.identity()})
        assert isinstance(info, bytes)
        return info

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        cuda = self._cuda
        if cuda is None:
            raise DriverError(f"{self.name}: connect() before open()")
        try:
            doc = msgpack.unpackb(info)
            same_process = int(doc["pid"]) == os.getpid()
            listed = [(int(r["ptr"]), int(r["length"]), r.get("base"), r.get("handle")) for r in doc["regions"]]
        except Exception as exc:
            raise DriverError(f"{self.name}: the peer's connection info is not a CUDA IPC export: {exc}") from exc
        target = _Peer(stream=cuda.stream())
        try:
            for ptr, length, base, handle in listed:
                if handle is None:
                    continue  # host memory (aux): reached through notices
                if same_process:
                    target.add(ptr, length, ptr)
                    continue
                if int(base) not in target.opened:
                    target.opened[int(base)] = cuda.ipc_open(bytes(handle))
                target.add(ptr, length, target.opened[int(base)] + (ptr - int(base)))
        except KVTransportError as exc:
            self._drop(target)
            raise DriverError(f"{self.name}: cannot open the peer's CUDA IPC handles: {exc}") from exc
        self._peers[peer] = target
        process = process_sockets.identity_in(doc)
        if process is not None:
            self._processes[peer] = process

    def fence(self, peer: str) -> bool:
        """The peer's KV writes are its own copies into memory this side exported by CUDA IPC,
        which this side cannot revoke while the memory lives: fenced once that process has
        ended (and its aux notices, checked, once idle: the SPI's two-sided default)."""
        if not super().fence(peer):
            return False
        process = self._processes.get(peer) or self._departed.get(peer)
        return process is not None and process_sockets.ended(process)

    def submit(self, peer: str, runs: Runs) -> int:
        target = self._peers.get(peer)
        if target is None or self._cuda is None or self._regions is None:
            raise DriverError(f"{self.name}: submit to {peer!r} before open()/connect()")
        mapped, device_runs = target.translate(runs.dst)
        host_runs = ~device_runs
        if host_runs.any():
            # Aux slots: host memory on both sides, carried by value in a notice.
            src, length = runs.src[host_runs], runs.length[host_runs]
            data = b"".join(ctypes.string_at(int(s), int(n)) for s, n in zip(src, length, strict=True))
            notice = {"op": "aux", "dst": runs.dst[host_runs].tobytes(), "len": length.tobytes(), "data": data}
            self.context.send_notice(peer, msgpack.packb(notice))
        for s, d, n in zip(
            runs.src[device_runs].tolist(), mapped[device_runs].tolist(), runs.length[device_runs].tolist(), strict=True
        ):
            self._cuda.copy_async(d, s, n, target.stream)
        self._next += 1
        self._batches[self._next] = (peer, self._cuda.record(target.stream))
        return self._next

    def poll(self, handle: int) -> bool:
        entry = self._batches.get(handle)
        if entry is None:
            raise DriverError(f"{self.name}: unknown handle {handle}")
        if not self._cuda.event_done(entry[1]):
            return False
        del self._batches[handle]
        self._cuda.destroy_event(entry[1])
        return True

    def abort(self, handle: int) -> None:
        # Copies already on the stream cannot be recalled: the handle is forgotten at once, and
        # its event kept until they ended (``settled``), so nobody reuses the pages before.
        entry = self._batches.pop(handle, None)
        if entry is not None and self._cuda is not None:
            self._settling[handle] = entry[1]

    def settled(self, handle: int) -> bool:
        event = self._settling.get(handle)
        if event is None or self._cuda is None:
            return True
        if not self._cuda.event_done(event):
            return False
        del self._settling[handle]
        self._cuda.destroy_event(event)
        return True

    def pending(self) -> int:
        return len(self._batches)

    def on_notice(self, peer: str, payload: bytes) -> None:
        assert self._regions is not None
        try:
            msg = msgpack.unpackb(payload)
            dst = np.frombuffer(msg["dst"], dtype=np.uint64)
            length = np.frombuffer(msg["len"], dtype=np.uint64)
            data = msg["data"]
            if msg["op"] != "aux" or dst.size != length.size or int(length.sum()) != len(data):
                raise ValueError("inconsistent aux notice")
            check_runs_within(dst, length, [r for r in self._regions.all() if r.kind.is_host], "aux destination")
            if not self.context.check_inbound(peer, dst, length):
                return  # late data of a transfer that failed: written nowhere
        except Exception as exc:
            raise ProtocolError(f"{self.name}: bad aux notice from {peer}: {exc}") from exc
        offset = 0
        for d, n in zip(dst.tolist(), length.tolist(), strict=True):
            ctypes.memmove(d, data[offset : offset + n], n)
            offset += n

    def disconnect(self, peer: str) -> None:
        process = self._processes.pop(peer, None)
        if process is not None:  # ``fence`` is asked again while its pages are held
            self._departed[peer] = process
            while len(self._departed) > MAX_DEPARTED:
                self._departed.popitem(last=False)
        target = self._peers.pop(peer, None)
        if target is not None:
            for handle, (owner, event) in list(self._batches.items()):
                if owner == peer:
                    del self._batches[handle]
                    self._cuda.destroy_event(event)
            self._drop(target)

    def _drop(self, target: _Peer) -> None:
        self._cuda.destroy_stream(target.stream)  # waits for its copies before unmapping
        for ptr in target.opened.values():
            self._cuda.ipc_close(ptr)
        target.opened.clear()

    def close(self) -> None:
        if self._cuda is None:
            return
        for peer in list(self._peers):
            self.disconnect(peer)  # destroying each stream waits for its copies
        for event in self._settling.values():
            self._cuda.destroy_event(event)
        self._settling.clear()
        self._cuda.release()
        self._cuda = None


@dataclass
class _Peer:
    """A connected peer: its stream, the IPC mappings opened, its device regions translated."""

    stream: Any
    opened: dict[int, int] = field(default_factory=dict)  # peer allocation base -> mapped here
    starts: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    ends: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    mapped: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))

    def add(self, ptr: int, length: int, mapped: int) -> None:
        """File one peer region (at connect time; kept sorted for :meth:`translate`)."""
        order = np.argsort(np.append(self.starts, np.uint64(ptr)), kind="stable")
        self.starts = np.append(self.starts, np.uint64(ptr))[order]
        self.ends = np.append(self.ends, np.uint64(ptr + length))[order]
        self.mapped = np.append(self.mapped, np.uint64(mapped))[order]

    def translate(self, dst: np.ndarray[Any, np.dtype[np.uint64]]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(addresses in this process, which runs hit device regions) for peer addresses."""
        if not self.starts.size:
            return dst, np.zeros(dst.shape, dtype=bool)
        i = np.searchsorted(self.starts, dst, side="right") - 1
        valid = i >= 0
        i = np.where(valid, i, 0)
        hit = valid & (dst < self.ends[i])
        return np.where(hit, self.mapped[i] + (dst - self.starts[i]), np.uint64(0)), hit
